"""Multi-turn reuse in real vLLM (CPU): time to first token of turns 2..T with the
conversation's KV moved back from the decode instance and without it, for kvpush (push and
pull) and vLLM's own ``NixlConnector`` (``bidirectional_kv_xfer``), in two scenarios.

* **No affinity**: the prefill instance runs without prefix caching (a prefill pool that
  does not keep conversations), so a turn without reuse computes the whole conversation.
* **Sticky**: the prefill instance keeps prefix caching, so it holds the previous prompt and
  lacks only the previous answer; kvpush decides per request from its measured costs
  whether loading it beats computing it (``vllm_reuse.ReuseCosts``).

Each configuration gets fresh servers: prefill on core 0, decode on core 1, both
``kv_both``. kvpush with ``reuse`` on; vLLM's ``NixlConnector`` with NIXL's progress-thread
spin removed (``benchmarks/vllm/anchors.py``, as in ``benchmarks.vllm.compare``) and
``bidirectional_kv_xfer`` on both sides (its default ``kv_recompute_threshold``, 64
tokens). Driven as vLLM's multi-turn proxy drives them: the decode leg is not streamed
(where vLLM returns ``kv_transfer_params``) and the next turn's prefill request carries them
as they came. Per configuration, C conversations of T turns run twice on the same servers
with distinct random prompts: with the kept turn passed on ("reuse") and without ("none").
Each turn appends the previous answer and new user tokens. TTFT of a turn: pull (kvpush pull
and vLLM), the prefill leg's wall time plus the decode instance's own TTFT (vLLM's
``time_to_first_token_seconds`` histogram, one request at a time); push, both legs leave
together and the decode's TTFT is the turn's. The prefill instance's own TTFT (its histogram:
its wait for the kept KV and its compute) beside it says how much of a turn is the prefill's
and how much the hand-off and the decode's first step. KV bytes moved: kvpush's byte
counters on the prefill instance (back) and the decode instance (forward). Then one
colocated instance with prefix caching replays every conversation turn by turn: its TTFT,
and every reused turn's tokens (and vLLM's bidirectional turns') must equal its
(``vllm_mt_tokens_match``).

Writes, turns 2..T, TTFT p50 ratios (higher is better unless named): no affinity
``vllm_mt_ttft_reuse_speedup_push`` / ``_pull`` (none / reuse),
``vllm_mt_ttft_push_over_vllm_bidir`` (kvpush push with reuse / vLLM bidirectional, lower
is better), sticky ``vllm_mt_sticky_ttft_reuse_speedup`` (the worse of push and pull:
reuse must never be slower), ``vllm_mt_tokens_match``, and a ``vllm_multiturn`` section
with every figure, into ``benchmarks/results/vllm_multiturn.json``, keeping every other key
there.

Run: ``.venv-vllm/bin/python -m benchmarks.vllm.multiturn`` from the repository root
(``bash .ci/bootstrap-vllm`` first); ``--quick`` for a short smoke run; ``--only`` to run
some configurations.
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


#: kvpush's byte counters (prefill instance: moved back; decode instance: moved forward)
BYTES = "vllm:kvpush_bytes_transferred_sum"
#: vLLM's proxy sends these with a prefill request that has no kept turn
NO_KEPT = {"remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
           "remote_port": None}
CONFIGS = ("kvpush", "kvpush_sticky", "vllm_bidir")


def _grown(url: str, before: float) -> float:
    """The TTFT sum's growth past ``before`` (it lands a step after the response)."""
    deadline = time.monotonic() + 10
    value = launch.metrics(url).get(TTFT, 0.0) - before
    while value <= 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        value = launch.metrics(url).get(TTFT, 0.0) - before
    return value


def turn(prefill: launch.Process, decode: launch.Process, prefill_kv: int, prompt: list[int],
         mode: str, kept: dict[str, Any] | None, answer: int
         ) -> tuple[float, float, list[int], dict[str, Any] | None]:
    """(TTFT s, the prefill instance's own TTFT s, tokens, the decode's kv_transfer_params)
    of one turn. ``mode``: kvpush's ``push`` / ``pull``, or ``vllm`` (vLLM's NixlConnector:
    its proxy's keys, a pull). The prefill's TTFT is its wait for the kept KV and its
    compute; the rest of the turn's is the hand-off and the decode's first step."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": answer, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    rid = str(uuid.uuid4())
    params: dict[str, Any] = {**(kept or (NO_KEPT if mode == "vllm" else {})),
                              "do_remote_decode": True, "do_remote_prefill": False}
    if mode != "vllm":
        params["transfer_mode"] = mode
    elif kept and not kept.get("remote_host"):
        params["remote_host"] = "127.0.0.1"
    first = dict(body, max_tokens=1, kv_transfer_params=params)
    before = launch.metrics(decode.url).get(TTFT, 0.0)
    before_p = launch.metrics(prefill.url).get(TTFT, 0.0)
    if mode != "push":
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
    ttft = _grown(decode.url, before)
    return (leg + ttft, _grown(prefill.url, before_p), list(out["choices"][0]["token_ids"]),
            out.get("kv_transfer_params"))


def start_pair(config: str, model: Path, work: Path, fleet: launch.Fleet
               ) -> tuple[launch.Process, launch.Process, int]:
    """Fresh prefill (core 0) and decode (core 1) servers for ``config``; the prefill's
    kvpush port (0 for vLLM's connector)."""
    common = ["-O0", "--max-num-seqs", "8"]
    p_port, d_port = launch.free_port(), launch.free_port()
    p_extra = common if config == "kvpush_sticky" else [*common, "--no-enable-prefix-caching"]
    p_env: dict[str, str] = {}
    d_env: dict[str, str] = {}
    if config == "vllm_bidir":
        p_kv = 0
        p_cfg = launch.nixl_config("kv_both", "NixlConnectorNoSpin",
                                   engine_id=f"mt-prefill-{uuid.uuid4().hex[:8]}",
                                   bidirectional_kv_xfer=True)
        d_cfg = launch.nixl_config("kv_both", "NixlConnectorNoSpin",
                                   bidirectional_kv_xfer=True)
        for cfg in (p_cfg, d_cfg):
            cfg["kv_connector_module_path"] = "anchors"
        anchors = str(REPO / "benchmarks" / "vllm")
        p_env = {"PYTHONPATH": anchors, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(launch.free_port())}
        d_env = {"PYTHONPATH": anchors, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(launch.free_port())}
    else:
        p_kv, d_kv = launch.free_port(), launch.free_port()
        p_cfg = launch.kvpush_config("kv_both", p_kv, reuse=True, request_timeout_s=10.0,
                                     kv_load_failure_policy="recompute")
        d_cfg = launch.kvpush_config("kv_both", d_kv, reuse=True, lease_s=120.0)
    prefill = fleet.add(launch.start_vllm(model, p_port, name=f"{config}-prefill", cores="0",
                                          log_dir=work, extra_args=p_extra,
                                          kv_transfer_config=p_cfg, env=p_env))
    decode = fleet.add(launch.start_vllm(model, d_port, name=f"{config}-decode", cores="1",
                                         log_dir=work, extra_args=common,
                                         kv_transfer_config=d_cfg, env=d_env))
    launch.wait_healthy([prefill, decode], timeout_s=600)
    return prefill, decode, p_kv


def _moved(url: str) -> float:
    return launch.metrics(url).get(BYTES, 0.0)


def play(config: str, mode: str, prefill: launch.Process, decode: launch.Process, p_kv: int,
         args: argparse.Namespace, rng: np.random.Generator
         ) -> tuple[dict[str, Any], list[tuple[str, list[list[int]], list[list[int]]]]]:
    """C conversations with reuse and without on these servers: figures, and per way and
    conversation (way, prompts, answers) for the colocated check."""
    ttft: dict[str, list[float]] = {"reuse": [], "none": []}
    prefill_ttft: dict[str, list[float]] = {"reuse": [], "none": []}
    moved = {w: {"back": 0.0, "forward": 0.0} for w in ttft}
    played = []
    for _ in range(args.conversations):
        for way in ("reuse", "none"):
            # distinct prompts per way: a prefix cache must not hold the other way's turns
            prompt = [int(x) for x in rng.integers(10, 1000, args.first_tokens)]
            users = [[int(x) for x in rng.integers(10, 1000, args.user_tokens)]
                     for _ in range(args.turns)]
            kept, prompts, said = None, [], []
            for k in range(args.turns):
                back, fwd = (_moved(prefill.url), _moved(decode.url)) if p_kv else (0, 0)
                t, t_p, tokens, params = turn(prefill, decode, p_kv, prompt, mode,
                                              kept if way == "reuse" else None,
                                              args.answer_tokens)
                prompts.append(prompt)
                said.append(tokens)
                if k:
                    ttft[way].append(t)
                    prefill_ttft[way].append(t_p)
                    if p_kv:
                        time.sleep(0.2)   # the counters land a step after the response
                        moved[way]["back"] += _moved(prefill.url) - back
                        moved[way]["forward"] += _moved(decode.url) - fwd
                kept = params
                prompt = prompt + tokens + users[k]
            played.append((way, prompts, said))
    p50 = {w: statistics.median(v) for w, v in ttft.items()}
    p90 = {w: float(np.percentile(v, 90)) for w, v in ttft.items()}
    figures: dict[str, Any] = {
        "ttft_p50_ms": {w: round(v * 1e3, 2) for w, v in p50.items()},
        "ttft_p90_ms": {w: round(v * 1e3, 2) for w, v in p90.items()},
        "prefill_instance_ttft_p50_ms": {w: round(statistics.median(v) * 1e3, 2)
                                         for w, v in prefill_ttft.items()},
        "speedup": round(p50["none"] / p50["reuse"], 3)}
    if p_kv:
        figures["mb_moved_turns_2_on"] = {w: {d: round(b / 1e6, 2) for d, b in m.items()}
                                          for w, m in moved.items()}
    print(f"{config} {mode}: TTFT p50 turns 2..{args.turns}: without reuse "
          f"{p50['none'] * 1e3:.1f} ms, with {p50['reuse'] * 1e3:.1f} ms "
          f"({p50['none'] / p50['reuse']:.2f}x); the prefill instance's own TTFT p50: "
          f"{statistics.median(prefill_ttft['none']) * 1e3:.1f} / "
          f"{statistics.median(prefill_ttft['reuse']) * 1e3:.1f} ms", flush=True)
    return figures, played


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
    rng = np.random.default_rng(0)
    figures: dict[str, Any] = {}
    checked: list[tuple[str, list[list[int]], list[list[int]]]] = []
    began = time.monotonic()
    try:
        for config in args.only:
            prefill, decode, p_kv = start_pair(config, model, work, fleet)
            for mode in (("vllm",) if config == "vllm_bidir" else ("push", "pull")):
                figs, played = play(config, mode, prefill, decode, p_kv, args, rng)
                figures[f"{config}_{mode}"] = figs
                # reused turns must equal colocated; vLLM's, bidirectional or not, too
                checked += [(f"{config}_{mode}_{w}", p, a) for w, p, a in played
                            if w == "reuse" or mode == "vllm"]
            fleet.stop()
        # The reference: one colocated instance with prefix caching, turn by turn (a
        # reused turn's answer KV was computed by decode steps, as a colocated instance's
        # cached answer is; recomputing it in one batch may differ in the last bits).
        colo = fleet.add(launch.start_vllm(model, launch.free_port(), name="colocated",
                                           cores="0", log_dir=work,
                                           extra_args=["-O0", "--max-num-seqs", "8"]))
        launch.wait_healthy([colo], timeout_s=600)
        equal: dict[str, int] = {}
        colo_ttft: list[float] = []
        for name, prompts, answers in checked:
            for k, prompt in enumerate(prompts):
                before = launch.metrics(colo.url).get(TTFT, 0.0)
                out = _post(colo.url, {"model": "tiny", "prompt": prompt, "temperature": 0,
                                       "max_tokens": args.answer_tokens, "ignore_eos": True,
                                       "return_token_ids": True}, str(uuid.uuid4()))
                if k:
                    colo_ttft.append(launch.metrics(colo.url).get(TTFT, 0.0) - before)
                equal[name] = equal.get(name, 0) + \
                    (answers[k] == list(out["choices"][0]["token_ids"]))
        per = args.conversations * args.turns
        print(f"turns equal to colocated (of {per} each): {equal}; colocated TTFT p50 turns "
              f"2..{args.turns}: {statistics.median(colo_ttft) * 1e3:.1f} ms", flush=True)
    finally:
        fleet.stop()
    figures["colocated_ttft_p50_ms"] = round(statistics.median(colo_ttft) * 1e3, 2)
    figures["turns_equal_to_colocated"] = {**equal, "of_each": per}
    figures["wall_s"] = round(time.monotonic() - began, 1)
    out: dict[str, Any] = {}
    kvpush_reused = [n for n in equal if n.startswith("kvpush") and n.endswith("_reuse")]
    out["vllm_mt_tokens_match"] = all(equal[n] == per for n in kvpush_reused)
    if "kvpush" in args.only:
        out["vllm_mt_ttft_reuse_speedup_push"] = figures["kvpush_push"]["speedup"]
        out["vllm_mt_ttft_reuse_speedup_pull"] = figures["kvpush_pull"]["speedup"]
    if "kvpush_sticky" in args.only:
        out["vllm_mt_sticky_ttft_reuse_speedup"] = min(
            figures["kvpush_sticky_push"]["speedup"], figures["kvpush_sticky_pull"]["speedup"])
    if "kvpush" in args.only and "vllm_bidir" in args.only:
        out["vllm_mt_ttft_push_over_vllm_bidir"] = round(
            figures["kvpush_push"]["ttft_p50_ms"]["reuse"]
            / figures["vllm_bidir_vllm"]["ttft_p50_ms"]["reuse"], 3)
    out["vllm_multiturn"] = {"scenarios": {"kvpush, vllm_bidir": "no affinity (prefill "
                                           "without prefix caching)",
                                           "kvpush_sticky": "sticky (prefill with prefix "
                                           "caching)"},
                             "conversations": args.conversations, "turns": args.turns,
                             "first_tokens": args.first_tokens,
                             "user_tokens": args.user_tokens,
                             "answer_tokens": args.answer_tokens,
                             "machine": platform.machine(), **figures}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the tiny Llama, made here)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
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
