"""Layer-wise push against whole-request push, in real vLLM (CPU), side by side.

One prefill instance (core 0) with the adapter's ``layerwise`` set -- it hands every layer
to ``Producer.layer_done`` from ``save_kv_layer`` -- and one decode instance (core 1),
behind ``examples/vllm/router.py``. Each request is pushed either registered layer by layer
(``kvpush_layerwise: true``: layer ``i`` is written while layer ``i + 1`` computes) or whole
(``false``: the WRITE starts after the forward pass), alternating, one request at a time, on
long prompts, so both see the same machine. TTFT is the client's send -> first streamed
token through the router. Tokens of both ways must be equal.

Writes ``vllm_layerwise_ttft_over_whole`` (layer-wise TTFT p50 / whole-request TTFT p50 per
prompt length, geometric mean over lengths; lower is better) and a ``vllm_layerwise`` section into
``benchmarks/results/vllm_compare.json``, keeping every other key there.

Run: ``.venv-vllm/bin/python -m benchmarks.vllm.layerwise`` from the repository root
(``bash .ci/bootstrap-vllm`` first); ``--quick`` for a short smoke run. On a machine shared
with other work, repeat it: only the side-by-side ratio means something.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from examples.vllm import launch

REPO = Path(__file__).resolve().parents[2]

RESULTS = REPO / "benchmarks" / "results" / "vllm_compare.json"
KEY = "vllm_layerwise_ttft_over_whole"


def stream(url: str, prompt: list[int], layerwise: bool, output_tokens: int
           ) -> tuple[float, list[int]]:
    """(TTFT in seconds, tokens) of one streamed push request through the router."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True,
            "kvpush_mode": "push", "kvpush_layerwise": layerwise}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    tokens: list[int] = []
    first = 0.0
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and not first:
                    first = time.perf_counter()
                tokens += ids
    if not first:
        raise RuntimeError("no token streamed")
    return first - start, tokens


def p50_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 1)


def update_results(summary: dict[str, Any]) -> None:
    """Read-modify-write: add this benchmark's keys, keep every other key."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {}
    if RESULTS.exists():
        data = json.loads(RESULTS.read_text())
    data[KEY] = summary[KEY]
    data["vllm_layerwise"] = summary
    RESULTS.write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model folder (default: make a tiny Llama)")
    p.add_argument("--layers", type=int, default=16, help="layers of the tiny Llama")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 3584])
    p.add_argument("--repeats", type=int, default=8, help="requests per length and way")
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvpush-vllm-layerwise"))
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats = [1024], 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or args.workdir / f"tiny-llama-{args.layers}l"
    if args.model is None:
        launch.subprocess.run([sys.executable, str(REPO / "examples/vllm/make_tiny_model.py"),
                               str(model), "--layers", str(args.layers)], check=True,
                              timeout=300)
    logs = args.workdir / "logs"
    fleet = launch.Fleet()
    kv_port, p_port, d_port, r_port = (launch.free_port() for _ in range(4))
    producer = f"tcp://127.0.0.1:{kv_port}"
    # No prefix caching: each prompt is sent both ways, and the second must compute again.
    common = ["-O0", "--max-num-seqs", "4", "--no-enable-prefix-caching"]
    rng = np.random.default_rng(7)
    ttft: dict[str, dict[int, list[float]]] = {"layerwise": {}, "whole": {}}
    mismatched = 0
    try:
        prefill = fleet.add(launch.start_vllm(
            model, p_port, name="prefill", cores="0", log_dir=logs, extra_args=common,
            kv_transfer_config=launch.kvpush_config("kv_producer", kv_port, layerwise=True)))
        decode = fleet.add(launch.start_vllm(
            model, d_port, name="decode", cores="1", log_dir=logs, extra_args=common,
            kv_transfer_config=launch.kvpush_config("kv_consumer", producers=[producer])))
        router = fleet.add(launch.start_router(r_port, prefill=prefill.url, decode=decode.url,
                                               log_dir=logs, args=["--producers", producer]))
        launch.wait_healthy([prefill, decode, router], timeout_s=420)
        for server in (prefill, decode):  # see benchmarks.vllm.compare's warm_up
            launch.http_json(server.url + "/v1/completions",
                             {"model": "tiny", "prompt": list(range(10, 1034)),
                              "max_tokens": 2, "temperature": 0}, timeout=120)
        for way in (True, False):  # one of each first, not timed
            stream(router.url, [int(t) for t in rng.integers(7, 2048, 256)], way, 2)
        for length in args.lengths:
            for i in range(args.repeats):
                prompt = [int(t) for t in rng.integers(7, 2048, size=length)]
                ways = (True, False) if i % 2 == 0 else (False, True)
                got: dict[bool, list[int]] = {}
                for way in ways:
                    t, got[way] = stream(router.url, prompt, way, args.output_tokens)
                    ttft["layerwise" if way else "whole"].setdefault(length, []).append(t)
                mismatched += got[True] != got[False]
            print(f"[{length} tokens] TTFT p50 layer-wise {p50_ms(ttft['layerwise'][length])} "
                  f"ms, whole {p50_ms(ttft['whole'][length])} ms", flush=True)
        metrics = launch.metrics(decode.url)
        handed = "layer-wise push: layer 0" in prefill.log.read_text()
    finally:
        fleet.stop()
    # Per length, layer-wise p50 over whole p50; the key is their geometric mean (a median
    # pooled over lengths would fall between two lengths' clusters).
    ratios = {str(n): statistics.median(ttft["layerwise"][n]) / statistics.median(ts)
              for n, ts in ttft["whole"].items()}
    summary: dict[str, Any] = {
        KEY: round(statistics.geometric_mean(ratios.values()), 3),
        "ratio_by_length": {n: round(r, 3) for n, r in ratios.items()},
        "ttft_p50_ms": {way: {str(n): p50_ms(ts) for n, ts in by_len.items()}
                        for way, by_len in ttft.items()},
        "ttft_ms": {way: {str(n): [round(1e3 * t, 1) for t in ts] for n, ts in by_len.items()}
                    for way, by_len in ttft.items()},
        "token_mismatches": mismatched,
        "failed": metrics.get("vllm:kvpush_num_failed_total", 0),
        "layer_done_seen": handed,
        "meta": {"layers": args.layers, "lengths": args.lengths, "repeats": args.repeats,
                 "output_tokens": args.output_tokens, "machine": platform.node(),
                 "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "model": str(model)},
    }
    update_results(summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "ttft_ms"}, indent=1))
    return 0 if mismatched == 0 and handed and summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
