"""kvpush against vLLM's own NIXL connectors, in real vLLM, side by side.

Same machine, model, servers set-up and workload for every configuration:

* ``colocated``          -- one vLLM instance, no connector (the reference, and a baseline);
* ``kvpush_push``        -- kvpush, push (prefill and decode requests dispatched together);
* ``kvpush_pull``        -- kvpush, pull (prefill, then decode with the ticket), same servers;
* ``vllm_nixl_pull``     -- vLLM ``NixlConnector`` (READ), ``kv_buffer_device: cpu``;
* ``vllm_nixl_push``     -- vLLM ``NixlPushConnector`` (WRITE), halves paired by a shared
  ``X-Request-Id`` and dispatched together.

Each disaggregated pair runs prefill on core 0 and decode on core 1 (``taskset`` and
``VLLM_CPU_OMP_THREADS_BIND``; after start-up every thread is re-pinned, because vLLM's NIXL
worker moves its model thread on CPU), behind ``examples/vllm/router.py``. The colocated
instance gets core 0. At most two servers are alive at once.

Workload: a Poisson stream of requests at each rate, prompts of several lengths, greedy
decoding of ``--output-tokens`` tokens, streamed. Reported per configuration and rate:
TTFT p50/p99, TPOT (mean), throughput; and whether every request's tokens equal the
colocated instance's (run one request at a time). Writes
``benchmarks/results/vllm_compare.json`` and the table in ``docs/VLLM.md``.

Run: ``.venv-vllm/bin/python benchmarks/vllm_compare.py`` (``bash .ci/bootstrap-vllm``
first). ``--quick`` runs a short smoke version.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "vllm"))

import launch  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "vllm_compare.json"
DOC = REPO / "docs" / "VLLM.md"
TABLE_BEGIN = "<!-- vllm_compare table: begin -->"
TABLE_END = "<!-- vllm_compare table: end -->"
CONFIGS = ("colocated", "kvpush_push", "kvpush_pull", "vllm_nixl_pull", "vllm_nixl_push")


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


# -- client ----------------------------------------------------------------------------------
async def one_request(session: Any, url: str, req: Request, mode: str | None,
                      output_tokens: int, t0: float) -> Outcome:
    import aiohttp

    await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
    body: dict[str, Any] = {"model": "tiny", "prompt": req.prompt, "max_tokens": output_tokens,
                            "temperature": 0, "stream": True, "return_token_ids": True,
                            "ignore_eos": True}
    if mode:
        body["kvpush_mode"] = mode
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


def summarize(outs: list[Outcome], makespan: float, reference: list[list[int]] | None
              ) -> dict[str, Any]:
    ok = [o for o in outs if not o.error and o.tokens]
    ttft = sorted(o.ttft for o in ok)
    tpot = [o.tpot for o in ok if o.tpot == o.tpot]
    same = first_same = prefix = None
    if reference is not None:
        pairs = list(zip(outs, reference, strict=True))
        same = sum(1 for o, ref in pairs if o.tokens == ref)
        first_same = sum(1 for o, ref in pairs if o.tokens[:1] == ref[:1])
        prefix = round(statistics.fmean(_common_prefix(o.tokens, ref) for o, ref in pairs), 1)
    return {
        "requests": len(outs),
        "errors": len(outs) - len(ok),
        "ttft_p50_ms": round(1e3 * float(np.percentile(ttft, 50)), 1) if ttft else None,
        "ttft_p99_ms": round(1e3 * float(np.percentile(ttft, 99)), 1) if ttft else None,
        "tpot_mean_ms": round(1e3 * statistics.fmean(tpot), 2) if tpot else None,
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


def start_pair(name: str, model: Path, logs: Path, fleet: launch.Fleet, common: list[str]
               ) -> tuple[launch.Process, launch.Process, list[str], str | None]:
    """Start prefill (core 0) + decode (core 1) for ``name``; returns them, the router's
    arguments, and the default mode."""
    p_port, d_port = launch.free_port(), launch.free_port()
    if name == "kvpush":
        kv_port = launch.free_port()
        p_cfg = launch.kvpush_config("kv_producer", kv_port)
        d_cfg = launch.kvpush_config("kv_consumer")
        router_args = ["--producers", f"tcp://127.0.0.1:{kv_port}"]
        p_env: dict[str, str] = {}
        d_env: dict[str, str] = {}
    else:
        connector = "NixlPushConnector" if name == "vllm_nixl_push" else "NixlConnector"
        side_p, side_d = launch.free_port(), launch.free_port()
        engine = f"bench-prefill-{os.getpid()}"
        p_cfg = launch.nixl_config("kv_producer", connector, engine_id=engine)
        d_cfg = launch.nixl_config("kv_consumer", connector)
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_p)}
        d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_d)}
        router_args = ["--protocol", "nixl", "--nixl-engine-id", engine,
                       "--nixl-port", str(side_p)]
    prefill = fleet.add(launch.start_vllm(model, p_port, name=f"{name}-prefill", cores="0",
                                          log_dir=logs, kv_transfer_config=p_cfg,
                                          extra_args=common, env=p_env))
    decode = fleet.add(launch.start_vllm(model, d_port, name=f"{name}-decode", cores="1",
                                         log_dir=logs, kv_transfer_config=d_cfg,
                                         extra_args=common, env=d_env))
    return prefill, decode, router_args, None


def run_config_group(group: str, args: argparse.Namespace, model: Path, logs: Path,
                     workloads: dict[float, list[Request]],
                     reference: dict[float, list[list[int]]] | None,
                     results: dict[str, Any]) -> dict[float, list[list[int]]] | None:
    fleet = launch.Fleet()
    common = ["-O0", "--max-num-seqs", "32"]
    try:
        t0 = time.monotonic()
        if group == "colocated":
            server = fleet.add(launch.start_vllm(model, launch.free_port(), name="colocated",
                                                 cores="0", log_dir=logs, extra_args=common))
            launch.wait_healthy([server], 420)
            warm_up(server)
            targets = [("colocated", server.url, None)]
        else:
            prefill, decode, router_args, _ = start_pair(group, model, logs, fleet, common)
            launch.wait_healthy([prefill, decode], 420)
            launch.repin(prefill, "0")
            launch.repin(decode, "1")
            router = fleet.add(launch.start_router(launch.free_port(), prefill=prefill.url,
                                                   decode=decode.url, log_dir=logs,
                                                   args=router_args))
            launch.wait_healthy([router], 60)
            warm_up(prefill)
            warm_up(decode)
            if group == "kvpush":
                targets = [("kvpush_push", router.url, "push"),
                           ("kvpush_pull", router.url, "pull")]
            else:
                mode = "push" if group == "vllm_nixl_push" else "pull"
                targets = [(group, router.url, mode)]
        print(f"[{group}] up in {time.monotonic() - t0:.0f} s", flush=True)
        sequential: dict[float, list[list[int]]] | None = None
        for name, url, mode in targets:
            # a few requests through the whole path before measuring
            asyncio.run(run_load(url, make_workload(3, 5.0, [64, 300], 99), mode,
                                 args.output_tokens))
            if group == "colocated":
                # the reference tokens: every prompt alone
                sequential = {}
                for rate, wl in workloads.items():
                    toks = []
                    for r in wl:
                        outs, _ = asyncio.run(run_load(url, [Request(r.index, r.prompt, 0.0)],
                                                       None, args.output_tokens))
                        toks.append(outs[0].tokens)
                    sequential[rate] = toks
                reference = sequential
            results[name] = {}
            for rate, wl in workloads.items():
                outs, makespan = asyncio.run(run_load(url, wl, mode, args.output_tokens))
                summary = summarize(outs, makespan, reference[rate] if reference else None)
                results[name][str(rate)] = summary
                print(f"[{name}] rate {rate}/s: TTFT p50 {summary['ttft_p50_ms']} ms, p99 "
                      f"{summary['ttft_p99_ms']} ms, TPOT {summary['tpot_mean_ms']} ms, "
                      f"{summary['throughput_tok_s']} tok/s, errors {summary['errors']}, "
                      f"identical {summary['tokens_identical']}/{summary['requests']} "
                      f"(first token {summary['first_token_identical']}, mean identical "
                      f"prefix {summary['mean_identical_prefix_tokens']})",
                      flush=True)
        return sequential
    finally:
        fleet.stop()


def pooled_p50(results: dict[str, Any], name: str) -> float | None:
    values = [t for s in results.get(name, {}).values() for t in s["ttft_ms"]]
    return float(np.percentile(values, 50)) if values else None


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = ["| configuration | rate (req/s) | TTFT p50 (ms) | TTFT p99 (ms) | TPOT (ms) | "
             "throughput (tok/s) | errors | tokens = colocated |",
             "|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        for rate, s in results.get(name, {}).items():
            same = "—" if s["tokens_identical"] is None else \
                f"{s['tokens_identical']}/{s['requests']} (first token " \
                f"{s['first_token_identical']}/{s['requests']})"
            lines.append(f"| {name} | {rate} | {s['ttft_p50_ms']} | {s['ttft_p99_ms']} | "
                         f"{s['tpot_mean_ms']} | {s['throughput_tok_s']} | {s['errors']} | "
                         f"{same} |")
    ratios = meta["ratios"]
    lines += ["", "TTFT p50 over all rates pooled, kvpush push / vLLM push "
              f"(NixlPushConnector): **{ratios['vllm_ttft_p50_kvpush_push_over_vllm_push']}**; "
              "kvpush push / vLLM pull (NixlConnector): "
              f"**{ratios['vllm_ttft_p50_kvpush_push_over_vllm_pull']}** (lower is better).",
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
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--requests", type=int, default=32, help="requests per rate")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--configs", nargs="+", default=["colocated", "kvpush", "vllm_nixl_pull",
                                                    "vllm_nixl_push"])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvpush-vllm-compare"))
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite docs/VLLM.md")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.requests, args.lengths = [2.0], 6, [128, 512]
    if "colocated" not in args.configs:
        p.error("the colocated run is the reference; keep it in --configs")
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
    for group in ["colocated"] + [c for c in args.configs if c != "colocated"]:
        got = run_config_group(group, args, model, logs, workloads, reference, results)
        if group == "colocated":
            reference = got
    push, pull = pooled_p50(results, "vllm_nixl_push"), pooled_p50(results, "vllm_nixl_pull")
    ours = pooled_p50(results, "kvpush_push")
    ratios = {
        "vllm_ttft_p50_kvpush_push_over_vllm_push":
            round(ours / push, 3) if ours and push else None,
        "vllm_ttft_p50_kvpush_push_over_vllm_pull":
            round(ours / pull, 3) if ours and pull else None,
    }
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, vllm-cpu 0.32.0, "
                       "nixl 1.5.1, CPU memory",
            "command": " ".join([".venv-vllm/bin/python", "benchmarks/vllm_compare.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "rates": args.rates, "requests_per_rate": args.requests, "lengths": args.lengths,
            "output_tokens": args.output_tokens, "ratios": ratios}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**ratios, "meta": meta, "results": results}, indent=1))
    table = markdown(results, meta)
    print(table)
    if not args.no_doc and not args.quick:
        write_doc(table)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
