"""kvpush's Prometheus metrics in an engine that is not vLLM: a Producer and a Consumer,
tracked by :class:`kvpush.prometheus.KvpushMetrics`, served on ``/metrics``.

It moves ``--requests`` requests (half push, half pull) between the two endpoints, scrapes
its own ``/metrics`` over HTTP and prints the kvpush series, then keeps serving for
``--serve-s`` seconds (point Prometheus or ``curl http://127.0.0.1:PORT/metrics`` at it).

    pip install 'kvpush[prometheus]'
    python examples/prometheus_metrics.py --port 9400 --serve-s 60
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request

import numpy as np
import prometheus_client

import kvpush
from kvpush.prometheus import KvpushMetrics

LAYOUT = dict(num_layers=2, tokens_per_block=16, num_kv_heads=2, head_size=64,
              dtype="float16", kv_packed=True)


def make_layout(num_blocks: int) -> tuple[list[np.ndarray], kvpush.KVLayout]:
    """A small KV cache over numpy buffers (one packed K+V region per layer)."""
    block_bytes = 2 * 16 * 2 * 64 * 2
    buffers = [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(2)]
    return buffers, kvpush.KVLayout.from_buffers(buffers, num_blocks=num_blocks, **LAYOUT)


def scrape(port: int) -> str:
    """``/metrics`` as an HTTP client sees it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="port of /metrics (0: any free)")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--serve-s", type=float, default=0.0,
                    help="keep serving /metrics this long before exiting")
    args = ap.parse_args(argv)

    registry = prometheus_client.CollectorRegistry()
    metrics = KvpushMetrics(registry)
    server, thread = prometheus_client.start_http_server(args.port, addr="127.0.0.1",
                                                         registry=registry)
    port = server.server_port
    src_bufs, src = make_layout(2 * args.requests)
    dst_bufs, dst = make_layout(2 * args.requests)
    for buf in src_bufs:
        buf[:] = np.random.default_rng(0).integers(0, 256, buf.shape, dtype=np.uint8)
    try:
        with kvpush.Producer(src) as producer, kvpush.Consumer(dst) as consumer:
            metrics.track(producer)
            metrics.track(consumer)
            name = consumer.connect(producer.address)
            n = args.requests
            handles = consumer.expect_many([(f"push-{i}", [i], name) for i in range(n // 2)])
            producer.prefill_done_many([(f"push-{i}", [i]) for i in range(n // 2)])
            tickets = producer.prefill_done_many(
                [(f"pull-{i}", [i], kvpush.TransferMode.PULL) for i in range(n // 2, n)])
            handles += consumer.pull_many([(t, [i]) for i, t in
                                           zip(range(n // 2, n), tickets, strict=True)])
            for h in handles:
                assert isinstance(h, kvpush.TransferHandle), h
                h.wait(30).raise_for_state()
            deadline = time.monotonic() + 10   # releases come once the producer has seen
            while producer.pending and time.monotonic() < deadline:  # every transfer end
                time.sleep(0.01)
            assert all(np.array_equal(s[:n], d[:n]) for s, d in zip(src_bufs, dst_bufs,
                                                                    strict=True))
            for line in scrape(port).splitlines():
                if line.startswith("kvpush_") and "_bucket" not in line:
                    print(line)
            if args.serve_s > 0:
                print(f"serving http://127.0.0.1:{port}/metrics for {args.serve_s} s",
                      file=sys.stderr)
                time.sleep(args.serve_s)
            metrics.untrack(producer)
            metrics.untrack(consumer)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
