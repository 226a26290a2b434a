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
with distinct random prompts: with the kept turn passed on ("reuse") and without ("none"),
the two ways taking turns to go first, after ``--warmup`` uncounted rounds of both (a fresh
server's first requests are slower, and the prefill instance's first loads from a decode
instance carry the connection and the learning of what a load costs).
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
is better), sticky ``vllm_mt_sticky_ttft_reuse_speedup`` (the better of push and pull)
and ``_push`` / ``_pull`` (each: reuse must never be slower), and each of these speed-ups
per mode paired (``..._paired_push`` / ``_pull``: the median, over turns 2..T, of a turn's
TTFT without reuse divided by that of the same conversation index and turn with reuse,
played on the same servers seconds apart, so the machine's slow stretches hit both),
``vllm_mt_tokens_match``,
and a ``vllm_multiturn`` section with every figure, into
``benchmarks/results/vllm_multiturn.json``, keeping every other key there.

Run: ``.venv-vllm/bin/python -m benchmarks.vllm.multiturn`` from the repository root
(``bash .ci/bootstrap-vllm`` first); ``--quick`` for a short smoke run; ``--only`` to run
some configurations. The model and the servers' logs of the last run are in ``--workdir``
(default ``/tmp/kvpush-vllm-multiturn``; each run overwrites them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
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


#: the client's own stamps of each turn (``time.monotonic``), by request id
CLIENT: dict[str, dict[str, float]] = {}


def turn(prefill: launch.Process, decode: launch.Process, prefill_kv: int, prompt: list[int],
         mode: str, kept: dict[str, Any] | None, answer: int, rid: str = ""
         ) -> tuple[float, float, list[int], dict[str, Any] | None]:
    """(TTFT s, the prefill instance's own TTFT s, tokens, the decode's kv_transfer_params)
    of one turn. ``mode``: kvpush's ``push`` / ``pull``, or ``vllm`` (vLLM's NixlConnector:
    its proxy's keys, a pull). The prefill's TTFT is its wait for the kept KV and its
    compute; the rest of the turn's is the hand-off and the decode's first step."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": answer, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    rid = rid or str(uuid.uuid4())
    params: dict[str, Any] = {**(kept or (NO_KEPT if mode == "vllm" else {})),
                              "do_remote_decode": True, "do_remote_prefill": False}
    if mode != "vllm":
        params["transfer_mode"] = mode
    elif kept and not kept.get("remote_host"):
        params["remote_host"] = "127.0.0.1"
    first = dict(body, max_tokens=1, kv_transfer_params=params)
    before = launch.metrics(decode.url).get(TTFT, 0.0)
    before_p = launch.metrics(prefill.url).get(TTFT, 0.0)
    CLIENT[rid] = {"sent": time.monotonic()}   # one clock with the servers' stage stamps
    if mode != "push":
        start = time.perf_counter()
        done = _post(prefill.url, first, rid)
        leg = time.perf_counter() - start
        CLIENT[rid]["prefill_answered"] = time.monotonic()
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


_STAMP = re.compile(r"kvpush stage (\d+\.\d+) (\w+) (\S+) (r\d+|r-) ?(.*)$")
_ELAPSED = re.compile(r"elapsed (\d+\.\d+)")
_REQUEST = re.compile(r"request (\S+)")
#: the prefill instance's steps of a turn (``--stages``), in order, from its stamps
SPLIT = ("arrived -> load started", "load (kvpush loop)", "loop -> engine pickup",
         "pickup -> scheduler", "scheduler -> compute planned", "compute (forward)",
         "forward -> finished", "arrived -> finished", "let-go sent -> its result",
         "client -> prefill arrived", "pull: finished -> client has answer",
         "pull: client -> decode arrived", "decode: arrived -> load started",
         "decode: prefill done -> KV in", "decode: KV in -> engine pickup")


def _stamps(log: Path, rids: set[str]) -> dict[str, dict[str, float]]:
    """Each turn's first stamp of each stage in one server's log (``stage_log``), keyed by
    the benchmark's request id; a reverse load's stamps (named by the kept turn's
    ``reuse.<hex>``) join the turn whose ``loaded`` line names it. ``ready``: when
    kvpush's loop had the load (its start plus the result's ``elapsed``)."""
    by_id: dict[str, dict[str, float]] = {}
    owner: dict[str, str] = {}
    elapsed: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _STAMP.search(line)
        if m is None:
            continue
        t, stage, name, detail = float(m[1]), m[2], m[3], m[5]
        by_id.setdefault(name, {}).setdefault(stage, t)
        if stage == "loaded":
            el, req = _ELAPSED.search(detail), _REQUEST.search(detail)
            if el:
                elapsed.setdefault(name, float(el[1]))
            if req:
                owner[name] = req[1]
    out: dict[str, dict[str, float]] = {}
    for name, stamps in by_id.items():
        key = owner.get(name, name)
        rid = next((r for r in rids if r in key), None)
        if rid is None:
            continue
        turn_stamps = out.setdefault(rid, {})
        start = stamps.get("registered", stamps.get("pull_started"))
        if start is not None and name in elapsed:
            stamps = {**stamps, "ready": start + elapsed[name]}
        if name.startswith("reuse."):
            stamps = {f"reverse_{k}": v for k, v in stamps.items()}
        for k, v in stamps.items():
            turn_stamps.setdefault(k, v)
    return out


def stage_split(prefill: launch.Process, decode: launch.Process,
                rids: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Per way, the p50 (ms) of each step of :data:`SPLIT` over the turns named."""
    every = {r for v in rids.values() for r in v}
    pre, dec = _stamps(prefill.log, every), _stamps(decode.log, every)
    out: dict[str, dict[str, float]] = {}
    for way, names in rids.items():
        steps: dict[str, list[float]] = {k: [] for k in SPLIT}
        for rid in names:
            p, d = pre.get(rid, {}), dec.get(rid, {})
            t0, done = p.get("arrived"), p.get("prefill_done")
            start, ready = p.get("reverse_registered", p.get("reverse_pull_started")), \
                p.get("reverse_ready")
            seen = p.get("load_seen")     # stamped only for a load the turn waits on
            c = CLIENT.get(rid, {})
            d_start = d.get("registered", d.get("pull_started"))
            pairs = {"compute (forward)": (p.get("send_planned"), done),
                     "client -> prefill arrived": (c.get("sent"), t0),
                     "pull: finished -> client has answer": (p.get("finished"),
                                                             c.get("prefill_answered")),
                     "pull: client -> decode arrived": (c.get("prefill_answered"),
                                                        d.get("arrived")),
                     "decode: arrived -> load started": (d.get("arrived"), d_start),
                     "forward -> finished": (done, p.get("finished")),
                     "arrived -> finished": (t0, p.get("finished")),
                     "decode: prefill done -> KV in": (done, d.get("ready")),
                     "decode: KV in -> engine pickup": (d.get("ready"), d.get("loaded"))}
            if seen is not None:
                pairs.update({"arrived -> load started": (t0, start),
                              "load (kvpush loop)": (start, ready),
                              "loop -> engine pickup": (ready, p.get("reverse_loaded")),
                              "pickup -> scheduler": (p.get("reverse_loaded"), seen),
                              "scheduler -> compute planned": (seen, p.get("send_planned"))})
            else:
                pairs.update({"scheduler -> compute planned": (t0, p.get("send_planned")),
                              "let-go sent -> its result": (start, ready)})
            for k, (a, b) in pairs.items():
                if a is not None and b is not None:
                    steps[k].append((b - a) * 1e3)
        out[way] = {k: round(statistics.median(v), 2) for k, v in steps.items() if v}
        out[way]["turns"] = len(names)
    return out


def _cpu_s(proc: launch.Process) -> float:
    """CPU seconds (user + system) the server's processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in proc.group_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def start_pair(config: str, model: Path, work: Path, fleet: launch.Fleet,
               stages: bool = False, prefill_options: dict[str, Any] | None = None
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
                                     kv_load_failure_policy="recompute", stage_log=stages,
                                     **(prefill_options or {}))
        d_cfg = launch.kvpush_config("kv_both", d_kv, reuse=True, lease_s=120.0,
                                     stage_log=stages)
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
    cpu_ms: dict[str, dict[str, list[float]]] = {w: {"prefill": [], "decode": []}
                                                 for w in ttft}
    rids: dict[str, list[str]] = {w: [] for w in ttft}
    played = []
    # ``args.warmup`` rounds first, uncounted and unchecked: a fresh server's first requests
    # are slower whichever way, and the prefill instance's first loads from a decode
    # instance (the connection's, and one to learn what a load costs) would land in
    # whichever way went first. Then the ways take turns going first.
    for c in range(-args.warmup, args.conversations):
        counted = c >= 0
        for way in (("reuse", "none") if c % 2 == 0 else ("none", "reuse")):
            # distinct prompts per way: a prefix cache must not hold the other way's turns
            prompt = [int(x) for x in rng.integers(10, 1000, args.first_tokens)]
            users = [[int(x) for x in rng.integers(10, 1000, args.user_tokens)]
                     for _ in range(args.turns)]
            kept, prompts, said = None, [], []
            for k in range(args.turns):
                back, fwd = (_moved(prefill.url), _moved(decode.url)) if p_kv else (0, 0)
                cpu = (_cpu_s(prefill), _cpu_s(decode))
                rid = str(uuid.uuid4())
                t, t_p, tokens, params = turn(prefill, decode, p_kv, prompt, mode,
                                              kept if way == "reuse" else None,
                                              args.answer_tokens, rid)
                prompts.append(prompt)
                said.append(tokens)
                if k and counted:
                    ttft[way].append(t)
                    prefill_ttft[way].append(t_p)
                    rids[way].append(rid)
                    # the whole turn's CPU (its 48 decode steps too), on each server
                    cpu_ms[way]["prefill"].append((_cpu_s(prefill) - cpu[0]) * 1e3)
                    cpu_ms[way]["decode"].append((_cpu_s(decode) - cpu[1]) * 1e3)
                    if p_kv:
                        time.sleep(0.2)   # the counters land a step after the response
                        moved[way]["back"] += _moved(prefill.url) - back
                        moved[way]["forward"] += _moved(decode.url) - fwd
                kept = params
                prompt = prompt + tokens + users[k]
            if counted:
                played.append((way, prompts, said))
    p50 = {w: statistics.median(v) for w, v in ttft.items()}
    p90 = {w: float(np.percentile(v, 90)) for w, v in ttft.items()}
    figures: dict[str, Any] = {
        "ttft_p50_ms": {w: round(v * 1e3, 2) for w, v in p50.items()},
        "ttft_p90_ms": {w: round(v * 1e3, 2) for w, v in p90.items()},
        "prefill_instance_ttft_p50_ms": {w: round(statistics.median(v) * 1e3, 2)
                                         for w, v in prefill_ttft.items()},
        "speedup": round(p50["none"] / p50["reuse"], 3),
        # The same conversation index and turn without and with reuse, played one after
        # the other on these servers: a slow stretch of the machine hits both of a pair.
        "paired_speedup": round(statistics.median(
            n / r for n, r in zip(ttft["none"], ttft["reuse"], strict=True)), 3),
        "ttft_turns_ms": {w: [round(x * 1e3, 1) for x in v] for w, v in ttft.items()},
        "cpu_ms_per_turn_p50": {w: {s: round(statistics.median(v), 1) for s, v in c.items()}
                                for w, c in cpu_ms.items()}}
    if p_kv:
        figures["mb_moved_turns_2_on"] = {w: {d: round(b / 1e6, 2) for d, b in m.items()}
                                          for w, m in moved.items()}
    print(f"{config} {mode}: TTFT p50 turns 2..{args.turns}: without reuse "
          f"{p50['none'] * 1e3:.1f} ms, with {p50['reuse'] * 1e3:.1f} ms "
          f"({p50['none'] / p50['reuse']:.2f}x; paired {figures['paired_speedup']:.2f}x); "
          f"the prefill instance's own TTFT p50: "
          f"{statistics.median(prefill_ttft['none']) * 1e3:.1f} / "
          f"{statistics.median(prefill_ttft['reuse']) * 1e3:.1f} ms; CPU ms per turn "
          f"{figures['cpu_ms_per_turn_p50']}", flush=True)
    if args.stages and p_kv:
        time.sleep(0.5)   # the last lines reach the logs
        figures["prefill_stages_p50_ms"] = stage_split(prefill, decode, rids)
        for way, split in figures["prefill_stages_p50_ms"].items():
            print(f"  stages ({way}): {split}", flush=True)
    return figures, played


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else None
    work = args.workdir   # the servers' logs of the last run stay here (read by --stages)
    work.mkdir(parents=True, exist_ok=True)
    print(f"servers' logs in {work}", flush=True)
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
            prefill, decode, p_kv = start_pair(config, model, work, fleet, args.stages,
                                               dict(args.prefill_option))
            for mode in (("vllm",) if config == "vllm_bidir" else args.modes):
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
                reply = _post(colo.url, {"model": "tiny", "prompt": prompt, "temperature": 0,
                                         "max_tokens": args.answer_tokens, "ignore_eos": True,
                                         "return_token_ids": True}, str(uuid.uuid4()))
                if k:
                    colo_ttft.append(launch.metrics(colo.url).get(TTFT, 0.0) - before)
                equal[name] = equal.get(name, 0) + \
                    (answers[k] == list(reply["choices"][0]["token_ids"]))
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
    both = set(args.modes) == {"push", "pull"}
    if "kvpush" in args.only and both:
        out["vllm_mt_ttft_reuse_speedup_push"] = figures["kvpush_push"]["speedup"]
        out["vllm_mt_ttft_reuse_speedup_pull"] = figures["kvpush_pull"]["speedup"]
        for mode in ("push", "pull"):
            out[f"vllm_mt_ttft_reuse_speedup_paired_{mode}"] = \
                figures[f"kvpush_{mode}"]["paired_speedup"]
    if "kvpush_sticky" in args.only and both:
        for mode in ("push", "pull"):
            out[f"vllm_mt_sticky_ttft_reuse_speedup_{mode}"] = \
                figures[f"kvpush_sticky_{mode}"]["speedup"]
        out["vllm_mt_sticky_ttft_reuse_speedup"] = max(
            figures["kvpush_sticky_push"]["speedup"], figures["kvpush_sticky_pull"]["speedup"])
        for mode in ("push", "pull"):
            out[f"vllm_mt_sticky_ttft_reuse_speedup_paired_{mode}"] = \
                figures[f"kvpush_sticky_{mode}"]["paired_speedup"]
    if "kvpush" in args.only and "push" in args.modes and "vllm_bidir" in args.only:
        out["vllm_mt_ttft_push_over_vllm_bidir"] = round(
            figures["kvpush_push"]["ttft_p50_ms"]["reuse"]
            / figures["vllm_bidir_vllm"]["ttft_p50_ms"]["reuse"], 3)
    out["vllm_multiturn"] = {"scenarios": {"kvpush, vllm_bidir": "no affinity (prefill "
                                           "without prefix caching)",
                                           "kvpush_sticky": "sticky (prefill with prefix "
                                           "caching)"},
                             "conversations": args.conversations, "turns": args.turns,
                             "warmup_rounds": args.warmup,
                             "first_tokens": args.first_tokens,
                             "user_tokens": args.user_tokens,
                             "answer_tokens": args.answer_tokens,
                             "machine": platform.machine(), **figures}
    return out


def _option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the tiny Llama, made here)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1,
                   help="rounds of one conversation each way played first, not counted")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--modes", nargs="+", choices=("push", "pull"), default=["push", "pull"],
                   help="kvpush's modes to run")
    p.add_argument("--stages", action="store_true",
                   help="kvpush's stage_log on: where the prefill instance's time of a turn "
                        "goes (prefill_stages_p50_ms)")
    p.add_argument("--prefill-option", type=_option, action="append", default=[],
                   metavar="KEY=JSON", help="a kvpush option of the prefill instance "
                   "(kv_connector_extra_config), e.g. idle_yield_s=0.002")
    p.add_argument("--quick", action="store_true", help="2 conversations x 3 turns, shorter")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvpush-vllm-multiturn"),
                   help="the model made here and the servers' logs (each run overwrites them)")
    args = p.parse_args(argv)
    if args.warmup < 0 or args.conversations < 1 or args.turns < 2:
        p.error("needs --warmup >= 0, --conversations >= 1 and --turns >= 2")
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
