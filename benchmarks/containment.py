"""What the contained data plane costs: ``TransportConfig(data_plane="child")`` beside the
in-process agent, measured side by side.

Two producer processes (one per mode) and two consumers in this process (one per mode),
each pair on one host (UCX's shared-memory transports, mode ``none``), every KV cache in
shared memory (``kvpush.shared_array``) for both modes so only the data plane differs.
Requests alternate between the modes, so both see the same noise:

* **handover**: a one-block push, ``prefill_done`` sent to the producer process ->
  READY at the consumer (the consumer registered first), p50; and the same for a
  one-block pull (ticket -> READY).
* **throughput**: one request at a time of ``BIG`` blocks, WRITE (push) and READ (pull),
  GB/s (median).

    python -m benchmarks.containment [--quick]

Summary keys: ``contained_handover_over_inprocess`` (push handover p50, contained /
in-process: above 1 is slower), ``contained_pull_handover_over_inprocess``,
``contained_write_vs_inprocess`` and ``contained_read_vs_inprocess`` (GB/s, contained /
in-process: below 1 is slower).
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

NAME = "containment"
DESCRIPTION = ("The contained data plane (TransportConfig(data_plane='child')) beside the "
               "in-process agent")
SUMMARY_KEYS: dict[str, str] = {
    "contained_handover_over_inprocess":
        "one-block push handover p50, contained over in-process (above 1: slower)",
    "contained_pull_handover_over_inprocess": "the same for a pull",
    "contained_{op}_vs_inprocess":
        "32 MiB WRITE or READ GB/s, contained over in-process (below 1: slower)",
}

MODES = ("inprocess", "child")
BLOCK_BYTES = 64 * 1024        # per region: 16 tokens x 8 heads x 128 x bf16 x (K, V)
REGIONS = 4                    # layers
NUM_BLOCKS = 256
BIG = 128                      # blocks per throughput request (32 MiB)


def make_cache() -> tuple[list[np.ndarray], kvpush.KVLayout]:
    buffers = [kvpush.shared_array((NUM_BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(REGIONS)]
    layout = kvpush.KVLayout.from_buffers(
        buffers, num_layers=REGIONS, num_blocks=NUM_BLOCKS, tokens_per_block=16,
        num_kv_heads=8, head_size=128, dtype="bfloat16")
    return buffers, layout


def _producer(conn: Any, mode: str) -> None:
    buffers, layout = make_cache()
    for i, buf in enumerate(buffers):
        buf[:] = (i * 7 + 1) % 251
    config = kvpush.ProducerConfig(host="127.0.0.1",
                                   transport=kvpush.TransportConfig(data_plane=mode))
    with kvpush.Producer(layout, config) as producer:
        conn.send(producer.address)
        while conn.poll(300):
            msg = conn.recv()
            if msg is None:
                break
            rid, ids, pull = msg
            ticket = producer.prefill_done(rid, ids, kvpush.TransferMode.PULL if pull
                                           else kvpush.TransferMode.PUSH)
            if pull:
                conn.send(ticket.to_bytes() if ticket is not None else None)
            deadline = time.monotonic() + 60
            while not producer.get_released():  # one request at a time
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{rid} not released")
                time.sleep(0.0002)
            conn.send(rid)


def run(quick: bool = False, progress: bool = True, small_reps: int | None = None,
        big_reps: int | None = None) -> dict[str, Any]:
    small_reps = small_reps or (40 if quick else 200)
    big_reps = big_reps or (4 if quick else 12)
    ctx = mp.get_context("spawn")
    procs: dict[str, Any] = {}
    conns: dict[str, Any] = {}
    consumers: dict[str, kvpush.Consumer] = {}
    names: dict[str, str] = {}
    keep = []
    handover: dict[str, dict[str, list[float]]] = {m: {"push": [], "pull": []} for m in MODES}
    gbps: dict[str, dict[str, list[float]]] = {m: {"push": [], "pull": []} for m in MODES}
    t_start = {}
    try:
        for mode in MODES:
            conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_producer, args=(child_conn, mode), daemon=True)
            proc.start()
            procs[mode], conns[mode] = proc, conn
        for mode in MODES:
            if not conns[mode].poll(120):
                raise TimeoutError(f"producer ({mode}) did not start")
            address = conns[mode].recv()
            buffers, layout = make_cache()
            keep.append(buffers)
            t0 = time.monotonic()
            consumers[mode] = kvpush.Consumer(layout, kvpush.ConsumerConfig(
                transport=kvpush.TransportConfig(data_plane=mode)))
            t_start[mode] = time.monotonic() - t0
            names[mode] = consumers[mode].connect(address, timeout=60)
        rng = np.random.default_rng(0)

        def one(mode: str, rid: str, n: int, pull: bool) -> float:
            consumer, conn = consumers[mode], conns[mode]
            src = rng.choice(NUM_BLOCKS, n, replace=False)
            dst = rng.choice(NUM_BLOCKS, n, replace=False)
            if pull:
                conn.send((rid, src, True))
                if not conn.poll(60):
                    raise TimeoutError("no ticket")
                ticket = conn.recv()
                t0 = time.perf_counter()
                result = consumer.pull(ticket, dst, timeout=60).wait(60)
            else:
                handle = consumer.expect(rid, dst, names[mode], timeout=60)
                t0 = time.perf_counter()
                conn.send((rid, src, False))
                result = handle.wait(60)
            took = time.perf_counter() - t0
            if not result.ok:
                raise RuntimeError(f"{rid} ({mode}): {result}")
            if not conn.poll(60):
                raise TimeoutError("the producer did not release")
            conn.recv()
            return took

        for rep in range(small_reps):
            for pull in (False, True):
                for mode in (MODES if rep % 2 else MODES[::-1]):  # interleaved, both orders
                    kind = "pull" if pull else "push"
                    handover[mode][kind].append(one(mode, f"h-{mode}-{kind}-{rep}", 1, pull))
        nbytes = BIG * BLOCK_BYTES * REGIONS
        for rep in range(big_reps):
            for pull in (False, True):
                for mode in (MODES if rep % 2 else MODES[::-1]):
                    kind = "pull" if pull else "push"
                    took = one(mode, f"t-{mode}-{kind}-{rep}", BIG, pull)
                    gbps[mode][kind].append(nbytes / took / 1e9)
        for mode in MODES:
            conns[mode].send(None)
    finally:
        for consumer in consumers.values():
            consumer.close()
        for proc in procs.values():
            proc.join(20)
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
    med = {m: {k: statistics.median(v) for k, v in handover[m].items()} for m in MODES}
    thr = {m: {k: statistics.median(v) for k, v in gbps[m].items()} for m in MODES}
    rows = [{"mode": m, "push_handover_p50_us": med[m]["push"] * 1e6,
             "pull_handover_p50_us": med[m]["pull"] * 1e6,
             "write_gbps": thr[m]["push"], "read_gbps": thr[m]["pull"],
             "consumer_start_s": t_start[m]} for m in MODES]
    summary = {
        "contained_handover_over_inprocess": med["child"]["push"] / med["inprocess"]["push"],
        "contained_pull_handover_over_inprocess":
            med["child"]["pull"] / med["inprocess"]["pull"],
        "contained_write_vs_inprocess": thr["child"]["push"] / thr["inprocess"]["push"],
        "contained_read_vs_inprocess": thr["child"]["pull"] / thr["inprocess"]["pull"],
    }
    if progress:
        for row in rows:
            print(f"  {row['mode']:>9}: handover p50 push {row['push_handover_p50_us']:7.0f} us,"
                  f" pull {row['pull_handover_p50_us']:7.0f} us; WRITE "
                  f"{row['write_gbps']:5.2f} GB/s, READ {row['read_gbps']:5.2f} GB/s "
                  f"({nbytes / 2**20:.0f} MiB); consumer start {row['consumer_start_s']:.2f} s",
                  file=sys.stderr)
    return {"rows": rows, "small_reps": small_reps, "big_reps": big_reps,
            "big_bytes": nbytes, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = run(args.quick)
    path = Path(__file__).parent / "results" / "containment.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
