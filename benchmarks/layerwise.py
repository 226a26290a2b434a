"""Layer-wise push vs whole-request push on the critical path.

A producer process runs a synthetic prefill whose layers each take ``layer_ms`` (a sleep:
this models compute that leaves the CPU free for the transfer, as a GPU prefill does). With
whole-request push the WRITE starts after the last layer; with layer-wise push
(``Producer.layer_done`` after every layer, ``Consumer.expect(..., layerwise=True)``) each
layer's WRITE overlaps the next layers' compute. TTFT here is arrival -> all KV landed on
the consumer (this process).

    python -m benchmarks.layerwise [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import kvpush

__all__ = ["run"]

NAME = "layerwise"
DESCRIPTION = "Layer-wise push against whole-request push under a synthetic per-layer prefill"
SUMMARY_KEYS: dict[str, str] = {
    "layerwise_ttft_over_whole":
        "TTFT (arrival -> all KV landed) layer-wise over whole-request, largest request",
    "layerwise_ttft_whole_ms": "whole-request TTFT there, ms",
    "layerwise_ttft_layerwise_ms": "layer-wise TTFT there, ms",
}

# A Qwen3-32B-like layer count, with a per-layer KV slice sized so that one request's
# transfer is comparable to its compute on this machine's memory bandwidth.
LAYERS = 32
TOKENS_PER_BLOCK = 16
HEADS, HEAD_SIZE = 8, 128          # bf16 -> 32 KiB per block per K or V region
BLOCK_BYTES = TOKENS_PER_BLOCK * HEADS * HEAD_SIZE * 2


def make_cache(num_blocks: int) -> tuple[list[np.ndarray], kvpush.KVLayout]:
    buffers = [np.zeros((num_blocks, BLOCK_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]
    layout = kvpush.KVLayout.from_buffers(
        buffers, num_layers=LAYERS, num_blocks=num_blocks, tokens_per_block=TOKENS_PER_BLOCK,
        num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype="bfloat16", kv_packed=False)
    return buffers, layout


def _producer(conn: Any, num_blocks: int) -> None:
    buffers, layout = make_cache(num_blocks)
    for i, buf in enumerate(buffers):
        buf[:] = i % 251
    with kvpush.Producer(layout) as producer:
        conn.send(producer.address)
        while conn.poll(120):
            msg = conn.recv()
            if msg is None:
                break
            rid, ids, layer_ms, layerwise = msg
            for layer in range(LAYERS):
                time.sleep(layer_ms / 1e3)
                if layerwise:
                    producer.layer_done(rid, ids, layer)
            producer.prefill_done(rid, ids)
            while not producer.get_released():  # one request at a time: wait for its release
                time.sleep(0.0005)
            conn.send(rid)


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Measure both modes side by side; returns the figures (and
    ``layerwise_ttft_over_whole``: p50 TTFT layer-wise / whole-request, lower is better)."""
    blocks_per_req = [16, 64] if quick else [16, 64, 128]
    reps = 5 if quick else 15
    layer_ms = 0.5
    num_blocks = max(blocks_per_req) * 2
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child_conn, num_blocks), daemon=True)
    proc.start()
    rows = []
    try:
        if not conn.poll(60):
            raise TimeoutError("producer did not start")
        address = conn.recv()
        _, layout = make_cache(num_blocks)
        with kvpush.Consumer(layout) as consumer:
            name = consumer.connect(address, timeout=30)
            rng = np.random.default_rng(0)
            for n in blocks_per_req:
                ttft: dict[str, list[float]] = {"whole": [], "layerwise": []}
                for rep in range(reps):
                    for mode in ("whole", "layerwise"):  # interleaved: same noise for both
                        src = rng.choice(num_blocks, n, replace=False)
                        dst = rng.choice(num_blocks, n, replace=False)
                        rid = f"{mode}-{n}-{rep}"
                        t0 = time.monotonic()
                        handle = consumer.expect(rid, dst, name, layerwise=mode == "layerwise")
                        conn.send((rid, src, layer_ms, mode == "layerwise"))
                        result = handle.wait(60)
                        ttft[mode].append(time.monotonic() - t0)
                        if not result.ok:
                            raise RuntimeError(f"{rid}: {result}")
                        if not conn.poll(30):
                            raise TimeoutError("producer did not finish a request")
                        conn.recv()
                whole = statistics.median(ttft["whole"])
                lw = statistics.median(ttft["layerwise"])
                mib = n * layout.bytes_per_block_id / 2**20
                rows.append({"blocks": n, "mib_per_request": mib, "compute_ms": LAYERS * layer_ms,
                             "ttft_whole_ms": whole * 1e3, "ttft_layerwise_ms": lw * 1e3,
                             "ratio": lw / whole})
                if progress:
                    print(f"  {n:>4} blocks ({mib:6.1f} MiB): whole {whole * 1e3:7.2f} ms, "
                          f"layer-wise {lw * 1e3:7.2f} ms, ratio {lw / whole:.2f}",
                          file=sys.stderr)
        conn.send(None)
    finally:
        proc.join(15)
        if proc.is_alive() and proc.pid:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
    biggest = rows[-1]
    model = (f"{LAYERS} layers x {layer_ms} ms (sleep), K+V bf16 {BLOCK_BYTES} B per block "
             "per region")
    return {"layerwise_ttft_over_whole": biggest["ratio"], "layerwise_rows": rows,
            "layerwise_model": model,
            "summary": {"layerwise_ttft_over_whole": biggest["ratio"],
                        "layerwise_ttft_whole_ms": biggest["ttft_whole_ms"],
                        "layerwise_ttft_layerwise_ms": biggest["ttft_layerwise_ms"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = run(args.quick)
    path = Path(__file__).parent / "results" / "layerwise.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
