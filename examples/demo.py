"""kvpush demo: a prefill process and a decode process move KV over NIXL, push vs pull.

Three processes, as in disaggregated serving:

* the **router** (this process) routes each request to the prefill and the decode engine;
* the **prefill engine** owns a :class:`kvpush.Producer`; per request it allocates source
  blocks, "computes" them (random bytes, and a sleep that grows with the prompt), checksums
  them in C++, and calls ``prefill_done``;
* the **decode engine** owns a :class:`kvpush.Consumer`; per request it allocates
  destination blocks and either registers them at once (push) or, once the router relays the
  prefill's pull ticket, READs (pull). When the data has landed it checksums its blocks.

The router compares the two checksums of every request (every byte of every block, in every
layer), then prints per-mode latency: *TTFT* is arrival -> all KV on the decode side;
*handover* is prefill done -> all KV on the decode side.

Run ``bash examples/demo.sh`` (sets up .venv), or ``python examples/demo.py --help``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvpush
from kvpush import _core  # the demo checksums blocks with the compiled hasher

# A small, model-shaped cache: 4 layers, K and V separate, 16 tokens per block,
# 2 KV heads x 64, fp16 -> 4 KiB per block per region, 32 KiB per block id.
LAYOUT = dict(num_layers=4, tokens_per_block=16, num_kv_heads=2, head_size=64,
              dtype="float16", kv_packed=False)


def make_cache(num_blocks: int) -> tuple[list[np.ndarray], kvpush.KVLayout]:
    block_bytes = 16 * 2 * 64 * 2
    buffers = [np.zeros((num_blocks, block_bytes), dtype=np.uint8)
               for _ in range(LAYOUT["num_layers"] * 2)]
    return buffers, kvpush.KVLayout.from_buffers(buffers, num_blocks=num_blocks, **LAYOUT)


def checksum(buffers: list[np.ndarray], layout: kvpush.KVLayout, ids: np.ndarray) -> int:
    bases = np.array([b.ctypes.data for b in buffers], dtype=np.uint64)
    sums = _core.block_checksums(bases, layout.block_stride, layout.block_bytes, ids,
                                 layout.num_blocks)
    return int(np.bitwise_xor.reduce(sums * np.arange(1, len(ids) + 1, dtype=np.uint64))) \
        if len(ids) else 0


class BlockPool:
    """Free block ids, handed out scattered (as a real engine's allocator does over time)."""

    def __init__(self, n: int, seed: int) -> None:
        self._free = list(np.random.default_rng(seed).permutation(n))
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            if n > len(self._free):
                raise RuntimeError("block pool exhausted")
            out, self._free = self._free[:n], self._free[n:]
        return np.array(out, dtype=np.int64)

    def give(self, ids: np.ndarray) -> None:
        with self._lock:
            self._free.extend(int(i) for i in ids)


# -- the prefill engine ---------------------------------------------------------------------
def prefill_main(conn: Any, num_blocks: int, us_per_token: float) -> None:
    buffers, layout = make_cache(num_blocks)
    pool = BlockPool(num_blocks, seed=1)
    send_lock = threading.Lock()

    def on_release(release: kvpush.Release) -> None:
        pool.give(release.block_ids)
        if release.reason is not kvpush.ReleaseReason.TRANSFERRED:
            with send_lock:
                conn.send(("released", release.request_id, release.reason.value))

    rng = np.random.default_rng(2)
    with kvpush.Producer(layout, on_release=on_release) as producer:
        conn.send(("ready", producer.address))
        while conn.poll(120):
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            rid, tokens, mode = args
            ids = pool.take(-(-tokens // LAYOUT["tokens_per_block"]))
            for buf in buffers:  # "compute" the KV: fresh random bytes in every layer
                buf[ids] = rng.integers(0, 256, size=(len(ids), buf.shape[1]), dtype=np.uint8)
            time.sleep(tokens * us_per_token * 1e-6)
            digest = checksum(buffers, layout, ids)
            ticket = producer.prefill_done(rid, ids, kvpush.TransferMode(mode))
            with send_lock:
                conn.send(("prefilled", rid, time.monotonic(), digest,
                           ticket.to_bytes() if ticket else None))
        conn.send(("stats", producer.stats()))


# -- the decode engine ----------------------------------------------------------------------
def decode_main(conn: Any, num_blocks: int, producer_address: str) -> None:
    buffers, layout = make_cache(num_blocks)
    pool = BlockPool(num_blocks, seed=3)
    send_lock = threading.Lock()
    blocks: dict[str, np.ndarray] = {}

    def on_finished(result: kvpush.TransferResult) -> None:
        ready_at = time.monotonic()  # before the check below, which is the demo's own cost
        ids = blocks.pop(result.request_id)
        digest = checksum(buffers, layout, ids) if result.ok else 0
        pool.give(ids)  # the demo decodes nothing: free the blocks once checked
        with send_lock:
            conn.send(("ready", result.request_id, ready_at, result.state.value,
                       digest, str(result.error or "")))

    with kvpush.Consumer(layout, on_finished=on_finished) as consumer:
        producer = consumer.connect(producer_address, timeout=30)
        conn.send(("connected", producer))
        while conn.poll(120):
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            rid, tokens = args[0], args[1]
            ids = pool.take(-(-tokens // LAYOUT["tokens_per_block"]))
            blocks[rid] = ids
            if cmd == "expect":
                consumer.expect(rid, ids, producer)
            else:
                consumer.pull(args[2], ids)
        conn.send(("stats", consumer.stats()))


# -- the router -----------------------------------------------------------------------------
@dataclass
class Request:
    rid: str
    mode: str
    tokens: int
    arrival: float = 0.0
    prefilled: float = 0.0
    ready: float = 0.0
    src_digest: int | None = None
    dst_digest: int | None = None
    state: str = ""
    error: str = ""
    events: list[str] = field(default_factory=list)


def run_mode(mode: str, n: int, prefill: Any, decode: Any, rng: np.random.Generator,
             window: int, tokens_range: tuple[int, int]) -> list[Request]:
    """Send ``n`` requests with at most ``window`` in flight; returns them finished."""
    reqs = [Request(f"{mode}-{i}", mode, int(rng.integers(*tokens_range))) for i in range(n)]
    by_id = {r.rid: r for r in reqs}
    sent = done = 0
    deadline = time.monotonic() + 300
    while done < n:
        while sent < n and sent - done < window:
            r = reqs[sent]
            r.arrival = time.monotonic()
            if mode == "push":  # dispatch to both engines at once
                decode.send(("expect", r.rid, r.tokens))
            prefill.send(("prefill", r.rid, r.tokens, mode))
            sent += 1
        for conn in mp.connection.wait([prefill, decode], timeout=5):
            msg = conn.recv()
            r = by_id[msg[1]]
            if msg[0] == "prefilled":
                r.prefilled, r.src_digest = msg[2], msg[3]
                if mode == "pull":  # relay the ticket: decode learns the blocks only now
                    decode.send(("pull", r.rid, r.tokens, msg[4]))
            elif msg[0] == "ready":
                r.ready, r.state, r.dst_digest, r.error = msg[2], msg[3], msg[4], msg[5]
                done += 1
            elif msg[0] == "released":
                r.events.append(f"source released: {msg[2]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{mode}: {n - done} requests unfinished after 300 s")
    return reqs


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per mode")
    ap.add_argument("--window", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--us-per-token", type=float, default=1.0,
                    help="simulated prefill compute per prompt token (microseconds)")
    ap.add_argument("--blocks", type=int, default=2048, help="KV blocks per engine")
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    prefill = ctx.Process(target=prefill_main, args=(p_child, args.blocks, args.us_per_token),
                          name="prefill")
    prefill.start()
    procs = [prefill]
    try:
        if not p_conn.poll(60):
            raise TimeoutError("prefill engine did not start")
        _, address = p_conn.recv()
        decode = ctx.Process(target=decode_main, args=(d_child, args.blocks, address),
                             name="decode")
        decode.start()
        procs.append(decode)
        if not d_conn.poll(60):
            raise TimeoutError("decode engine did not connect")
        print(f"prefill pid {prefill.pid} serves {address}; decode pid {decode.pid} connected "
              f"to {d_conn.recv()[1]}")
        rng = np.random.default_rng(0)
        results = {}
        for mode in ("push", "pull"):
            t0 = time.monotonic()
            results[mode] = run_mode(mode, args.requests, p_conn, d_conn, rng, args.window,
                                     (args.min_tokens, args.max_tokens))
            print(f"{mode}: {args.requests} requests in {time.monotonic() - t0:.2f} s")
        for conn in (p_conn, d_conn):
            conn.send(("stop",))
        bad = 0
        print()
        print(f"{'mode':<6}{'ok':>6}{'bytes ok':>10}{'TTFT p50':>11}{'p90':>9}{'p99':>9}"
              f"{'handover p50':>15}{'p90':>9}{'p99':>9}   (ms)")
        for mode, reqs in results.items():
            ok = [r for r in reqs if r.state == "ready"]
            good = [r for r in ok if r.src_digest == r.dst_digest]
            bad += len(reqs) - len(good)
            ttft = [r.ready - r.arrival for r in good]
            hand = [r.ready - r.prefilled for r in good]
            print(f"{mode:<6}{len(ok):>6}{len(good):>10}{pct(ttft, 50):>11.2f}{pct(ttft, 90):>9.2f}"
                  f"{pct(ttft, 99):>9.2f}{pct(hand, 50):>15.2f}{pct(hand, 90):>9.2f}"
                  f"{pct(hand, 99):>9.2f}")
            for r in reqs:
                if r not in good:
                    print(f"  {r.rid}: state={r.state} error={r.error} "
                          f"digest {r.src_digest} vs {r.dst_digest} {r.events}")
        print()
        print("every byte verified (64-bit checksum of every block in every layer)"
              if not bad else f"{bad} requests FAILED verification")
        return 1 if bad else 0
    finally:
        for proc in procs:
            proc.join(15)
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)


if __name__ == "__main__":
    sys.exit(main())
