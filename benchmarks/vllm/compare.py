"""kvpush against vLLM's own NIXL connectors, in real vLLM, side by side.

Same machine, model, servers set-up and workload for every configuration:

* ``colocated``          -- one vLLM instance, no connector (the reference, and a baseline);
* ``colocated_noop``     -- the same with a connector that does nothing loaded
  (``benchmarks/vllm/anchors.py``): what vLLM's connector machinery alone costs per step;
* ``kvpush_push``        -- kvpush, push (prefill and decode requests dispatched together);
* ``kvpush_pull``        -- kvpush, pull (prefill, then decode with the ticket), same servers;
* ``vllm_nixl_pull``     -- vLLM ``NixlConnector`` (READ), ``kv_buffer_device: cpu``;
* ``vllm_nixl_push``     -- vLLM ``NixlPushConnector`` (WRITE), halves paired by a shared
  ``X-Request-Id`` and dispatched together;
* ``vllm_nixl_pull_nospin`` / ``vllm_nixl_push_nospin`` -- the same two with NIXL's
  progress thread sleeping 1 ms between polls instead of spinning (a subclass,
  ``benchmarks/vllm/anchors.py``): vLLM's connectors at their best here, the anchor to beat;
* ``disagg_nomove``      -- the same prefill / decode / router set-up with no transfer: a
  do-nothing connector on the prefill instance, ``NoMoveLoadConnector`` on the decode
  instance (``benchmarks/vllm/anchors.py``), which declares each prompt loaded and moves
  nothing (its tokens are garbage, so they are not compared): vLLM's disaggregated decode
  path alone, the floor under any connector's decode TPOT;
* ``kvpush_push_tp2`` / ``kvpush_pull_tp2`` -- kvpush with a tensor-parallel-2 prefill
  instance (ranks unbound on both cores) feeding a TP-1 decode instance, float32 (a TP-2
  engine sums in another order than a TP-1 one, which in bfloat16 flips near-tied greedy
  choices of the tiny random model), against ``colocated_fp32`` (TP 1, float32), at a low
  rate: two cores are few for three engines.

Each disaggregated pair runs prefill on core 0 and decode on core 1 (``taskset`` and
``VLLM_CPU_OMP_THREADS_BIND``; after start-up every thread is re-pinned, because vLLM's NIXL
worker moves its model thread on CPU), behind ``examples/vllm/router.py`` (run at niceness
-10 as root, ``--router-nice``: at 0 it waited for a CPU slice behind the two engines at each
hop, 3-4 ms per request here, paid alike by every disaggregated set-up). The colocated
instance gets core 0. At most two servers are alive at once.

Workload: a Poisson stream of requests at each rate, prompts of several lengths, greedy
decoding of ``--output-tokens`` tokens, streamed. Reported per configuration and rate (and
per prompt length): TTFT and TPOT p50/p90, TTFT p50 over the colocated instance's,
throughput; and whether every request's tokens equal the colocated instance's (run one
request at a time). Writes ``benchmarks/results/vllm_compare.json`` (keys of other
benchmarks in it are kept, and so is a key of this one that a run with fewer ``--configs``
cannot compute, named in ``meta["keys_kept"]``) and the tables in ``docs/VLLM.md``.
Top-level keys:
``vllm_ttft_overhead_push_over_best_vllm`` (the worst rate's kvpush push TTFT p50 overhead
over colocated divided by the smallest such overhead of vLLM's four connector set-ups),
``vllm_tpot_p50_kvpush_minus_noop_ms`` (the worst rate's kvpush decode TPOT p50 minus the
do-nothing connector's, colocated), ``vllm_tpot_p50_kvpush_minus_nomove_ms`` (the same minus
``disagg_nomove``'s: what kvpush adds to a disaggregated decode server's TPOT; and
``..._median_ms``, the median over rates and modes, which the worst of six noisy
differences is not),
``vllm_tp2_tokens_match``, and
``vllm_ttft_p50_push_first_kvpush_minus_vllm_ms`` (for push with the first token streamed from
the prefill instance by the router, ``*_first``: kvpush's TTFT p50 overhead over colocated
minus that of vLLM's push with its spin removed, the router feature on both, worst rate; a
difference, since both sit near zero).

For kvpush's set-ups the adapter's ``stage_log`` and the router's ``--stage-log`` are on,
and each configuration and rate also gets ``stages``: where its requests' TTFT went, step by
step (``benchmarks/vllm/stages.py``; a table in the output).

Run: ``.venv-vllm/bin/python -m benchmarks.vllm.compare`` from the repository root
(``bash .ci/bootstrap-vllm`` first). ``--quick`` runs a short smoke version;
``--kvpush-option KEY=VALUE`` sets an adapter option on both kvpush instances (A/B runs of a
setting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from examples.vllm import launch

from . import stages as vllm_stages

REPO = Path(__file__).resolve().parents[2]

RESULTS = REPO / "benchmarks" / "results" / "vllm_compare.json"
DOC = REPO / "docs" / "VLLM.md"
TABLE_BEGIN = "<!-- vllm_compare table: begin -->"
TABLE_END = "<!-- vllm_compare table: end -->"
CONFIGS = ("colocated", "colocated_noop", "kvpush_push", "kvpush_pull", "kvpush_push_first",
           "kvpush_pull_first",
           "vllm_nixl_pull", "vllm_nixl_push", "vllm_nixl_pull_nospin", "vllm_nixl_push_nospin",
           "vllm_nixl_push_nospin_first", "disagg_nomove", "colocated_fp32",
           "kvpush_push_tp2", "kvpush_pull_tp2")
GROUPS = ("colocated", "noop", "kvpush", "vllm_nixl_pull", "vllm_nixl_push",
          "vllm_nixl_pull_nospin", "vllm_nixl_push_nospin", "disagg_nomove", "tp2")
VLLM_CONFIGS = ("vllm_nixl_pull", "vllm_nixl_push", "vllm_nixl_pull_nospin",
                "vllm_nixl_push_nospin")
#: Push with the first token streamed from the prefill instance by the router
#: (``--first-token prefill`` of examples/vllm/router.py), kvpush's and vLLM's: a router
#: feature, so compared with each other, never with the configurations above.
FIRST_TOKEN_CONFIGS = ("kvpush_push_first", "vllm_nixl_push_nospin_first")
#: benchmarks/vllm on the servers' path, for ``anchors`` (this package's doc says why not the
#: repository root)
ANCHORS = {"PYTHONPATH": str(Path(__file__).resolve().parent)}
#: TP-2 ranks and three engines on two cores starve kvpush's loop threads at times
#: (tests_vllm/test_vllm_tp.py): generous liveness settings for that shape.
SLOW = {"transfer_timeout_s": 120.0, "peer_timeout_s": 120.0, "heartbeat_s": 2.0}


@dataclass
class Request:
    index: int
    prompt: list[int]
    arrival: float          # seconds after the start of its rate's run


@dataclass
class Outcome:
    ttft: float = float("nan")
    tpot: float = float("nan")
    tokens: list[int] = field(default_factory=list)
    end: float = 0.0
    error: str = ""


def make_workload(n: int, rate: float, lengths: list[int], seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [Request(i, [int(t) for t in rng.integers(7, 2048, size=int(rng.choice(lengths)))],
                    float(arrivals[i])) for i in range(n)]


def _pct(values: list[float], q: float, scale: float = 1e3, digits: int = 1) -> float | None:
    return round(scale * float(np.percentile(values, q)), digits) if values else None


# -- client ----------------------------------------------------------------------------------
async def one_request(session: Any, url: str, req: Request, mode: str | None,
                      output_tokens: int, t0: float) -> Outcome:
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    body: dict[str, Any] = {"model": "tiny", "prompt": req.prompt, "max_tokens": output_tokens,
                            "temperature": 0, "stream": True, "return_token_ids": True,
                            "ignore_eos": True}
    if mode:  # "push", "pull", or "push+first": the first token from the prefill instance
        base, _, first = mode.partition("+")
        body["kvpush_mode"] = base
        if first:
            body["kvpush_first_token"] = "prefill"
    out = Outcome()
    start = time.perf_counter()
    first = last = 0.0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                ids: list[int] = []
                for choice in json.loads(line[5:]).get("choices", []):
                    ids += choice.get("token_ids") or []
                if ids:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    out.tokens += ids
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.end = time.perf_counter()
    if first:
        out.ttft = first - start
        if len(out.tokens) > 1:
            out.tpot = (last - first) / (len(out.tokens) - 1)
    return out


async def run_load(url: str, workload: list[Request], mode: str | None,
                   output_tokens: int) -> tuple[list[Outcome], float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter() + 0.05
        outs = await asyncio.gather(*(one_request(session, url, r, mode, output_tokens, t0)
                                      for r in workload))
    makespan = max((o.end for o in outs if o.end), default=t0) - t0
    return list(outs), makespan


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summarize(outs: list[Outcome], makespan: float, reference: list[list[int]] | None,
              workload: list[Request]) -> dict[str, Any]:
    ok = [o for o in outs if not o.error and o.tokens]
    ttft = sorted(o.ttft for o in ok)
    tpot = [o.tpot for o in ok if o.tpot == o.tpot]
    by_length: dict[str, dict[str, Any]] = {}
    for length in sorted({len(r.prompt) for r in workload}):
        mine = [o for o, r in zip(outs, workload, strict=True)
                if len(r.prompt) == length and not o.error and o.tokens]
        t1 = [o.ttft for o in mine]
        t2 = [o.tpot for o in mine if o.tpot == o.tpot]
        by_length[str(length)] = {"requests": len(mine),
                                  "ttft_p50_ms": _pct(t1, 50), "ttft_p90_ms": _pct(t1, 90),
                                  "tpot_p50_ms": _pct(t2, 50, digits=2),
                                  "tpot_p90_ms": _pct(t2, 90, digits=2)}
    same = first_same = prefix = None
    if reference is not None:
        pairs = list(zip(outs, reference, strict=True))
        same = sum(1 for o, ref in pairs if o.tokens == ref)
        first_same = sum(1 for o, ref in pairs if o.tokens[:1] == ref[:1])
        prefix = round(statistics.fmean(_common_prefix(o.tokens, ref) for o, ref in pairs), 1)
    return {
        "requests": len(outs),
        "errors": len(outs) - len(ok),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50, digits=2),
        "tpot_p90_ms": _pct(tpot, 90, digits=2),
        "tpot_mean_ms": round(1e3 * statistics.fmean(tpot), 2) if tpot else None,
        "by_length": by_length,
        "throughput_tok_s": round(sum(len(o.tokens) for o in ok) / makespan, 1)
        if makespan > 0 else None,
        "throughput_req_s": round(len(ok) / makespan, 2) if makespan > 0 else None,
        "tokens_identical": same,
        "first_token_identical": first_same,
        "mean_identical_prefix_tokens": prefix,
        "ttft_ms": [round(1e3 * t, 2) for t in ttft],
        "first_error": next((o.error for o in outs if o.error), ""),
    }


# -- servers ---------------------------------------------------------------------------------
def warm_up(server: launch.Process) -> None:
    """A long local prompt first: vLLM's CPU attention needs oneDNN's AMX set-up before a
    decode instance's first (one-token, long-context) step -- see kvpush's adapter."""
    launch.http_json(server.url + "/v1/completions",
                     {"model": "tiny", "prompt": list(range(10, 1034)), "max_tokens": 2,
                      "temperature": 0}, timeout=120)


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])     # utime + stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(servers: list[launch.Process], seconds: float = 3.0) -> float:
    """Cores the servers' processes use while no request is in flight (a spinning progress
    thread shows as ~1 per agent)."""
    time.sleep(2.0)   # past vLLM's own busy tails after the warm-up requests
    pids = [pid for s in servers for pid in s.group_pids()]
    before = _cpu_seconds(pids)
    time.sleep(seconds)
    return round((_cpu_seconds(pids) - before) / seconds, 3)


def start_pair(name: str, model: Path, logs: Path, fleet: launch.Fleet, common: list[str],
               kvpush_options: dict[str, Any] | None = None
               ) -> tuple[launch.Process, launch.Process, list[str]]:
    """Start prefill (core 0) + decode (core 1) for group ``name``; returns them and the
    router's arguments. ``tp2``: a TP-2 prefill instance, ranks unbound on both cores."""
    p_port, d_port = launch.free_port(), launch.free_port()
    p_cores, p_bind, p_extra = "0", None, list(common)
    d_extra = list(common)
    if name in ("kvpush", "tp2"):
        tp = 2 if name == "tp2" else 1
        kv_port = launch.free_port(tp)
        extra = {**(SLOW if tp > 1 else {}), **(kvpush_options or {})}
        producers = [f"tcp://127.0.0.1:{kv_port + r}" for r in range(tp)]
        p_cfg = launch.kvpush_config("kv_producer", kv_port, stage_log=True, **extra)
        d_cfg = launch.kvpush_config("kv_consumer", producers=producers, stage_log=True,
                                     **extra)
        router_args = ["--producers", *producers, "--stage-log"]
        p_env: dict[str, str] = {}
        d_env: dict[str, str] = {}
        if tp > 1:
            p_cores, p_bind = "0,1", "nobind"
            p_extra += ["--tensor-parallel-size", "2"]
    elif name == "disagg_nomove":
        p_cfg = {"kv_connector": "NoopConnector", "kv_connector_module_path": "anchors",
                 "kv_role": "kv_producer"}
        d_cfg = {"kv_connector": "NoMoveLoadConnector",
                 "kv_connector_module_path": "anchors", "kv_role": "kv_consumer"}
        p_env, d_env = dict(ANCHORS), dict(ANCHORS)
        # kvpush's push routing (both halves at once); the producer address is never used
        router_args = ["--producers", "tcp://127.0.0.1:9"]
    else:
        nospin = name.endswith("_nospin")
        push = name.startswith("vllm_nixl_push")
        connector = ("NixlPushConnector" if push else "NixlConnector") + (
            "NoSpin" if nospin else "")
        side_p, side_d = launch.free_port(), launch.free_port()
        engine = f"bench-prefill-{os.getpid()}-{name}"
        p_cfg = launch.nixl_config("kv_producer", connector, engine_id=engine)
        d_cfg = launch.nixl_config("kv_consumer", connector)
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_p)}
        d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_d)}
        if nospin:
            for cfg in (p_cfg, d_cfg):
                cfg["kv_connector_module_path"] = "anchors"
            p_env.update(ANCHORS)
            d_env.update(ANCHORS)
        router_args = ["--protocol", "nixl", "--nixl-engine-id", engine,
                       "--nixl-port", str(side_p)]
    prefill = fleet.add(launch.start_vllm(model, p_port, name=f"{name}-prefill",
                                          cores=p_cores, omp_bind=p_bind, log_dir=logs,
                                          kv_transfer_config=p_cfg, extra_args=p_extra,
                                          env=p_env))
    if name == "tp2":  # the decode instance connects to every prefill rank at start-up
        launch.wait_healthy([prefill], 600)
    decode = fleet.add(launch.start_vllm(model, d_port, name=f"{name}-decode", cores="1",
                                         log_dir=logs, kv_transfer_config=d_cfg,
                                         extra_args=d_extra, env=d_env))
    return prefill, decode, router_args


def _targets(group: str, url: str) -> list[tuple[str, str, str | None]]:
    if group == "kvpush":
        return [("kvpush_push", url, "push"), ("kvpush_pull", url, "pull"),
                ("kvpush_push_first", url, "push+first"),
                ("kvpush_pull_first", url, "pull+first")]
    if group == "vllm_nixl_push_nospin":
        return [(group, url, "push"), (f"{group}_first", url, "push+first")]
    if group == "tp2":
        return [("kvpush_push_tp2", url, "push"), ("kvpush_pull_tp2", url, "pull")]
    if group == "disagg_nomove":
        return [(group, url, "push")]
    return [(group, url, "push" if group.startswith("vllm_nixl_push") else "pull")]


def sequential_tokens(url: str, workloads: dict[float, list[Request]],
                      output_tokens: int) -> dict[float, list[list[int]]]:
    """The reference: every prompt alone."""
    out: dict[float, list[list[int]]] = {}
    for rate, wl in workloads.items():
        toks = []
        for r in wl:
            outs, _ = asyncio.run(run_load(url, [Request(r.index, r.prompt, 0.0)], None,
                                           output_tokens))
            toks.append(outs[0].tokens)
        out[rate] = toks
    return out


def run_config_group(group: str, args: argparse.Namespace, model: Path, logs: Path,
                     workloads: dict[float, list[Request]],
                     reference: dict[float, list[list[int]]] | None,
                     results: dict[str, Any]) -> dict[float, list[list[int]]] | None:
    """Run ``group``'s configurations over ``workloads``; returns the reference tokens when
    the group makes them (a colocated instance)."""
    fleet = launch.Fleet()
    # No prefix caching: every configuration sends the same prompts, and the colocated
    # reference pass computes them all first. With it on, whatever ran second found its
    # prompts cached (on a prefill and on a decode instance alike) and measured a cached
    # prefill against a computed one -- pull after push, colocated after its reference.
    common = ["-O0", "--max-num-seqs", "32", "--no-enable-prefix-caching"]
    if group in ("tp2", "colocated_fp32"):
        common += ["--dtype", "float32"]
    stage_logs: list[Path] = []
    try:
        t0 = time.monotonic()
        if group in ("colocated", "noop", "colocated_fp32"):
            name = "colocated_noop" if group == "noop" else group
            cfg = None
            env: dict[str, str] = {}
            if group == "noop":
                cfg = {"kv_connector": "NoopConnector", "kv_connector_module_path":
                       "anchors", "kv_role": "kv_both"}
                env = dict(ANCHORS)
            server = fleet.add(launch.start_vllm(model, launch.free_port(), name=name,
                                                 cores="0", log_dir=logs, extra_args=common,
                                                 kv_transfer_config=cfg, env=env))
            launch.wait_healthy([server], 420)
            warm_up(server)
            targets: list[tuple[str, str, str | None]] = [(name, server.url, None)]
            servers = [server]
        else:
            prefill, decode, router_args = start_pair(group, model, logs, fleet, common,
                                                      dict(args.kvpush_option))
            launch.wait_healthy([prefill, decode], 600)
            if group != "tp2":
                launch.repin(prefill, "0")
            launch.repin(decode, "1")
            router = fleet.add(launch.start_router(launch.free_port(), prefill=prefill.url,
                                                   decode=decode.url, log_dir=logs,
                                                   args=router_args, nice=args.router_nice))
            launch.wait_healthy([router], 60)
            warm_up(prefill)
            warm_up(decode)
            targets = _targets(group, router.url)
            servers = [prefill, decode]
            if group in ("kvpush", "tp2"):  # stage lines on (start_pair)
                stage_logs = [prefill.log, decode.log, router.log]
        idle = idle_cpu(servers)
        results.setdefault("_idle_cpu_cores", {})[group] = idle
        print(f"[{group}] up in {time.monotonic() - t0:.0f} s; idle CPU {idle} cores",
              flush=True)
        made: dict[float, list[list[int]]] | None = None
        for name, url, mode in targets:
            # a few requests through the whole path before measuring
            asyncio.run(run_load(url, make_workload(3, 5.0, [64, 300], 99), mode,
                                 args.output_tokens))
            if group in ("colocated", "colocated_fp32"):
                made = reference = sequential_tokens(url, workloads, args.output_tokens)
            results[name] = {}
            for rate, wl in workloads.items():
                began = time.monotonic()
                outs, makespan = asyncio.run(run_load(url, wl, mode, args.output_tokens))
                # disagg_nomove's tokens come from garbage KV: nothing to compare
                summary = summarize(outs, makespan, reference[rate]
                                    if reference and group != "disagg_nomove" else None, wl)
                if stage_logs:
                    summary["stages"] = stages_between(stage_logs, began, time.monotonic())
                results[name][str(rate)] = summary
                print(f"[{name}] rate {rate}/s: TTFT p50 {summary['ttft_p50_ms']} ms, p90 "
                      f"{summary['ttft_p90_ms']} ms, TPOT p50 {summary['tpot_p50_ms']} ms, "
                      f"{summary['throughput_tok_s']} tok/s, errors {summary['errors']}, "
                      f"identical {summary['tokens_identical']}/{summary['requests']} "
                      f"(first token {summary['first_token_identical']}, mean identical "
                      f"prefix {summary['mean_identical_prefix_tokens']})",
                      flush=True)
        return made
    finally:
        fleet.stop()


def stages_between(logs: list[Path], began: float, ended: float) -> dict[str, Any]:
    """Where the TTFT of the requests the router took in [began, ended] went (kvpush's
    set-ups: the adapter's ``stage_log`` and the router's ``--stage-log``;
    ``benchmarks/vllm/stages.py``)."""
    reqs = {rid: r for rid, r in vllm_stages.parse([str(p) for p in logs]).items()
            if began <= r.first("router_in") <= ended}
    return dict(vllm_stages.summarize(reqs))


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def merge_results(kept: dict[str, Any], keys: dict[str, Any], meta: dict[str, Any],
                  results: dict[str, Any]) -> dict[str, Any]:
    """The results file after this run: its keys, results and meta; the keys of other
    benchmarks (benchmarks/vllm/layerwise.py) kept; and a key this run could not compute (its groups
    were not run: None) keeps an earlier run's value, named in ``meta["keys_kept"]``."""
    out = dict(kept)
    earlier = {k: kept[k] for k, v in keys.items() if v is None and kept.get(k) is not None}
    out.update({**keys, **earlier, "meta": {**meta, "keys_kept": sorted(earlier)},
                "results": results})
    return out


def pooled_p50(results: dict[str, Any], name: str) -> float | None:
    values = [t for s in results.get(name, {}).values() for t in s["ttft_ms"]]
    return float(np.percentile(values, 50)) if values else None


def overheads(results: dict[str, Any], base: str = "colocated") -> None:
    """Each run's TTFT p50 over the colocated instance's at the same rate (ms), in place."""
    for name, runs in results.items():
        ref = results.get("colocated_fp32" if name.endswith("_tp2") else base, {})
        for rate, s in runs.items():
            r = ref.get(rate, {}).get("ttft_p50_ms")
            s["ttft_p50_over_colocated_ms"] = round(s["ttft_p50_ms"] - r, 1) \
                if r is not None and s["ttft_p50_ms"] is not None else None


def _tpot_gaps(results: dict[str, Any], anchor: str) -> list[float]:
    """kvpush push's and pull's decode TPOT p50 minus ``anchor``'s, ms, at every rate both
    have."""
    gaps = []
    for rate, theirs in results.get(anchor, {}).items():
        for name in ("kvpush_push", "kvpush_pull"):
            ours = results.get(name, {}).get(rate, {}).get("tpot_p50_ms")
            if ours is not None and theirs.get("tpot_p50_ms") is not None:
                gaps.append(round(ours - theirs["tpot_p50_ms"], 2))
    return gaps


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The summary keys (see the module docstring); None where a run is missing."""
    worst_ratio: float | None = None
    per_rate: dict[str, Any] = {}
    for rate, s in results.get("kvpush_push", {}).items():
        ours = s.get("ttft_p50_over_colocated_ms")
        theirs = [results[v][rate]["ttft_p50_over_colocated_ms"] for v in VLLM_CONFIGS
                  if rate in results.get(v, {})
                  and results[v][rate].get("ttft_p50_over_colocated_ms") is not None]
        best = min(theirs) if theirs else None
        # An anchor no slower than colocated leaves no overhead to halve: the ratio is
        # undefined there, and reported as such rather than as a huge number.
        ratio = round(ours / best, 3) if ours is not None and best and best > 0 else None
        per_rate[rate] = {"kvpush_push_over_colocated_ms": ours,
                          "best_vllm_over_colocated_ms": best, "ratio": ratio}
        if ratio is not None and (worst_ratio is None or ratio > worst_ratio):
            worst_ratio = ratio
    noop_gaps = _tpot_gaps(results, "colocated_noop")
    nomove_gaps = _tpot_gaps(results, "disagg_nomove")
    tp2 = [s for n in ("kvpush_push_tp2", "kvpush_pull_tp2")
           for s in results.get(n, {}).values()]
    tp2_match = bool(tp2) and all(s["errors"] == 0 and s["tokens_identical"] == s["requests"]
                                  for s in tp2)
    # Both overheads sit near zero with the first token from the prefill instance: their
    # ratio would be noise over noise, so the key is their difference (ms), worst rate.
    first: dict[str, Any] = {}
    worst_first: float | None = None
    for rate, s in results.get(FIRST_TOKEN_CONFIGS[0], {}).items():
        ours = s.get("ttft_p50_over_colocated_ms")
        theirs = results.get(FIRST_TOKEN_CONFIGS[1], {}).get(rate, {}).get(
            "ttft_p50_over_colocated_ms")
        gap = round(ours - theirs, 1) if ours is not None and theirs is not None else None
        first[rate] = {"kvpush_push_first_over_colocated_ms": ours,
                       "vllm_push_nospin_first_over_colocated_ms": theirs,
                       "kvpush_minus_vllm_ms": gap}
        if gap is not None and (worst_first is None or gap > worst_first):
            worst_first = gap
    push, pull = pooled_p50(results, "vllm_nixl_push"), pooled_p50(results, "vllm_nixl_pull")
    ours_pooled = pooled_p50(results, "kvpush_push")
    return {
        "vllm_ttft_overhead_push_over_best_vllm": worst_ratio,
        "vllm_tpot_p50_kvpush_minus_noop_ms": max(noop_gaps) if noop_gaps else None,
        "vllm_tpot_p50_kvpush_minus_nomove_ms": max(nomove_gaps) if nomove_gaps else None,
        # the worst of six noisy differences leans high; their median does not
        "vllm_tpot_p50_kvpush_minus_nomove_median_ms":
            round(statistics.median(nomove_gaps), 2) if nomove_gaps else None,
        "vllm_tp2_tokens_match": tp2_match if tp2 else None,
        "vllm_ttft_p50_kvpush_push_over_vllm_push":
            round(ours_pooled / push, 3) if ours_pooled and push else None,
        "vllm_ttft_p50_kvpush_push_over_vllm_pull":
            round(ours_pooled / pull, 3) if ours_pooled and pull else None,
        "vllm_ttft_overhead_by_rate": per_rate,
        "vllm_ttft_p50_push_first_kvpush_minus_vllm_ms": worst_first,
        "vllm_ttft_overhead_first_token_by_rate": first,
    }


def _tokens(s: dict[str, Any]) -> str:
    if s["tokens_identical"] is None:
        return "—"
    return (f"{s['tokens_identical']}/{s['requests']} (first token "
            f"{s['first_token_identical']}/{s['requests']})")


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["| configuration | rate (req/s) | TTFT p50 / p90 (ms) | TTFT p50 over colocated "
             "(ms) | TPOT p50 / p90 (ms) | throughput (tok/s) | errors | tokens = colocated |",
             "|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        for rate, s in results.get(name, {}).items():
            lines.append(f"| {name} | {rate} | {s['ttft_p50_ms']} / {s['ttft_p90_ms']} | "
                         f"{s['ttft_p50_over_colocated_ms']} | {s['tpot_p50_ms']} / "
                         f"{s['tpot_p90_ms']} | {s['throughput_tok_s']} | {s['errors']} | "
                         f"{_tokens(s)} |")
    lengths = sorted({int(k) for runs in results.values() for s in runs.values()
                      for k in s["by_length"]})
    lines += ["", "By prompt length (tokens): TTFT p50 / p90, TPOT p50 / p90 (ms).", "",
              "| configuration | rate | " + " | ".join(f"{n}" for n in lengths) + " |",
              "|---|---|" + "---|" * len(lengths)]
    for name in CONFIGS:
        for rate, s in results.get(name, {}).items():
            cells = []
            for n in lengths:
                b = s["by_length"].get(str(n))
                cells.append("—" if not b or not b["requests"] else
                             f"{b['ttft_p50_ms']} / {b['ttft_p90_ms']}, "
                             f"{b['tpot_p50_ms']} / {b['tpot_p90_ms']}")
            lines.append(f"| {name} | {rate} | " + " | ".join(cells) + " |")
    staged = [(name, rate, label, steps) for name in CONFIGS
              for rate, s in results.get(name, {}).items()
              for label, steps in (s.get("stages") or {}).items()]
    if staged:
        lines += ["", "Where kvpush's TTFT goes (`benchmarks/vllm/stages.py`, from the adapter's "
                  "`stage_log` and the router's `--stage-log`): p50 / p90 ms per step.", "",
                  "| configuration | rate | " + " | ".join(vllm_stages.STEPS) + " |",
                  "|---|---|" + "---|" * len(vllm_stages.STEPS)]
        for name, rate, _, steps in staged:
            cells = [f"{steps[st]['p50']} / {steps[st]['p90']}" if st in steps else "—"
                     for st in vllm_stages.STEPS]
            lines.append(f"| {name} | {rate} | " + " | ".join(cells) + " |")
    k = meta["keys"]
    lines += ["", "kvpush push's TTFT p50 overhead over colocated, divided by the smallest "
              "overhead among vLLM's connectors (as shipped and spin removed), at the worst "
              f"rate: **{k['vllm_ttft_overhead_push_over_best_vllm']}** (goal ≤ 0.5; per "
              f"rate: {json.dumps(k['vllm_ttft_overhead_by_rate'])}). kvpush decode TPOT p50 "
              "minus the do-nothing connector's, worst rate: "
              f"**{k['vllm_tpot_p50_kvpush_minus_noop_ms']} ms** (goal ≤ 0.1); minus the "
              "disaggregated set-up that moves nothing (`disagg_nomove`): "
              f"**{k.get('vllm_tpot_p50_kvpush_minus_nomove_ms')} ms** (median over rates and "
              f"modes {k.get('vllm_tpot_p50_kvpush_minus_nomove_median_ms')} ms). TP-2 prefill "
              f"→ TP-1 decode, every token equal: **{k['vllm_tp2_tokens_match']}**. Pooled "
              "TTFT p50, kvpush push / vLLM push: "
              f"{k['vllm_ttft_p50_kvpush_push_over_vllm_push']}; / vLLM pull: "
              f"{k['vllm_ttft_p50_kvpush_push_over_vllm_pull']}.",
              "", "With the first token streamed from the prefill instance by the router "
              "(`*_first`; compared with each other only): kvpush push's TTFT p50 overhead "
              "over colocated minus vLLM push's (spin removed), worst rate: "
              f"**{k.get('vllm_ttft_p50_push_first_kvpush_minus_vllm_ms')} ms** (per rate: "
              f"{json.dumps(k.get('vllm_ttft_overhead_first_token_by_rate'))}).",
              "", "Idle CPU of each set-up's servers (cores, 3 s with nothing in flight): "
              + ", ".join(f"{g} {c}" for g, c in meta.get("idle_cpu_cores", {}).items())
              + ".",
              "", f"Measured {meta['date']} on {meta['machine']}; command: `{meta['command']}`."]
    return "\n".join(lines)


def write_doc(table: str) -> None:
    if not DOC.exists():
        return
    text = DOC.read_text()
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        _, tail = rest.split(TABLE_END, 1)
        DOC.write_text(f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model folder (default: make the tiny model)")
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--requests", type=int, default=24, help="requests per rate")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1500])
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--configs", nargs="+", default=list(GROUPS), choices=GROUPS,
                   help="groups of configurations to run (colocated always runs)")
    p.add_argument("--kvpush-option", type=_option, action="append", default=[],
                   metavar="KEY=VALUE",
                   help="a kv_connector_extra_config entry for both kvpush instances (JSON "
                        "value, e.g. idle_yield_s=0.001); repeatable")
    p.add_argument("--tp2-rate", type=float, default=0.25)
    p.add_argument("--tp2-requests", type=int, default=6)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvpush-vllm-compare"))
    p.add_argument("--router-nice", type=int, default=-10 if os.geteuid() == 0 else 0,
                   help="the router's niceness (default -10 as root, else 0): on two cores "
                        "shared with two engines, a router at 0 waits for a CPU slice at "
                        "each hop, which every disaggregated set-up pays alike")
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/VLLM.md")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.requests, args.lengths = [2.0], 6, [128, 512]
        args.tp2_requests = 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or args.workdir / "tiny-llama"
    if args.model is None:
        launch.subprocess.run([sys.executable, str(REPO / "examples/vllm/make_tiny_model.py"),
                               str(model)], check=True, timeout=300)
    logs = args.workdir / "logs"
    workloads = {rate: make_workload(args.requests, rate, args.lengths, seed=int(rate * 1000))
                 for rate in args.rates}
    results: dict[str, Any] = {}
    reference: dict[float, list[list[int]]] | None = None
    started = time.monotonic()
    groups = ["colocated"] + [g for g in GROUPS if g in args.configs and g != "colocated"]
    for i, group in enumerate(groups, 1):
        print(f"== group {i}/{len(groups)}: {group} "
              f"({time.monotonic() - started:.0f} s so far)", flush=True)
        if group == "tp2":
            tp2_loads = {args.tp2_rate: make_workload(args.tp2_requests, args.tp2_rate,
                                                      args.lengths[:2], seed=2)}
            tp2_ref = run_config_group("colocated_fp32", args, model, logs, tp2_loads, None,
                                       results)
            run_config_group("tp2", args, model, logs, tp2_loads, tp2_ref, results)
            continue
        got = run_config_group(group, args, model, logs, workloads, reference, results)
        if group == "colocated":
            reference = got
    idle = results.pop("_idle_cpu_cores", {})
    overheads(results)
    keys = headline(results)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, vllm-cpu 0.32.0, "
                       "nixl 1.5.1, CPU memory",
            "command": " ".join([".venv-vllm/bin/python", "-m", "benchmarks.vllm.compare",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "rates": args.rates, "requests_per_rate": args.requests, "lengths": args.lengths,
            "output_tokens": args.output_tokens, "tp2_rate": args.tp2_rate,
            "tp2_requests": args.tp2_requests, "router_nice": args.router_nice,
            "kvpush_options": dict(args.kvpush_option),
            "keys": keys, "idle_cpu_cores": idle,
            "wall_s": round(time.monotonic() - started)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps(merge_results(kept, keys, meta, results), indent=1))
    table = markdown(results, meta)
    print(table)
    if not args.no_doc and not args.quick:
        write_doc(table)
    print(f"wrote {RESULTS} in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
