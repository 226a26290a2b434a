"""The protocol cores under a long stream of requests: per-request cost, its tail, memory.

No NIXL, sockets or threads: each request goes through :class:`ProducerCore` (a consumer's
registration, ``prefill_done``, the WRITE's end) and :class:`ConsumerCore` (``expect``, the
``Posted`` hint, the ``Landed`` notification) the way the facades feed them, at
``--rate`` requests per second of simulated time, with the library's default timeouts
(lease 60 s, tombstones 120 s, WRITE timeout 30 s; registrations wait up to 60 s). So
after two minutes of simulated time every core holds the tombstones of ``rate x 120``
ended uses, as a producer serving that rate does.

What it shows: the wall time of each request's calls (p50 / p99 / p99.9 / max over the
second half: the tail is where a full garbage collection, or a re-sort of a large timer
heap, stalls the loop thread that runs the core), the entries in each core's timers, the
objects the garbage collector tracks per request still held, and the growth of the
process's peak RSS. ``python -m benchmarks.core_stream [--requests N] [--rate R]
[--no-gc] [--json PATH]``
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from typing import Any

import numpy as np

from kvpush import messages as m
from kvpush.protocol.consumer import ConsumerCore
from kvpush.protocol.consumer import CoreConfig as ConsumerCoreConfig
from kvpush.protocol.effects import Post, XferEnd
from kvpush.protocol.producer import CoreConfig, ProducerCore
from kvpush.request import TransferMode
from kvpush.testing.fakes import FakeMemory, SimLinks

from ._common import save_json

__all__ = ["measure", "run", "table"]

NAME = "core_stream"
DESCRIPTION = ("The protocol cores alone (no NIXL, sockets or threads) under a long stream of "
               "requests: Python time per request, its tail, timers and memory")
SUMMARY_KEYS: dict[str, str] = {
    "core_{side}_us_p50":
        "one request's calls into the producer or consumer core, p50 us over the second half",
    "core_{side}_us_p99": "the same, p99 us",
    "core_{side}_us_max": "the same, the longest, us (a full garbage collection lands here)",
    "core_{side}_timer_entries": "entries in the core's timers at the end",
    "core_producer_tracked_per_record":
        "objects the garbage collector tracks per ended request the producer still holds",
    "core_producer_peak_rss_growth_mib": "growth of the process's peak RSS over the producer's run",
}

NUM_BLOCKS = 64
BLOCKS = 16          # per request
LAYERS = 2
PEER = "peer"


def _sides() -> tuple[FakeMemory, SimLinks]:
    """This side's memory (a real layout over numpy) and links that plan with the
    compiled planner against a peer's, as the facades' do (kvpush.testing's fakes)."""
    mine = FakeMemory(num_regions=LAYERS, num_blocks=NUM_BLOCKS)
    theirs = FakeMemory(num_regions=LAYERS, num_blocks=NUM_BLOCKS)
    return mine, SimLinks(mine, lambda name: theirs if name == PEER else None)


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def _stats(lat: list[float]) -> dict[str, float]:
    us = np.asarray(lat[len(lat) // 2:]) * 1e6
    return {"us_p50": float(np.median(us)), "us_p99": float(np.percentile(us, 99)),
            "us_p999": float(np.percentile(us, 99.9)), "us_max": float(us.max())}


def _producer(requests: int, step: float) -> dict[str, Any]:
    mine, links = _sides()
    core = ProducerCore(mine.layout, CoreConfig(), links)
    core.peer_up(0.0, PEER, mine.layout)
    ids = np.arange(BLOCKS, dtype=np.int64)
    enc = m.encode_ids(ids)
    now, lat = 0.0, []
    tracked0 = _tracked()
    for i in range(requests):
        rid = f"p{i}"
        t0 = time.perf_counter()
        core.on_message(now, PEER, m.Register(rid, i + 1, enc, 0, 60.0))
        core.drain()
        core.prefill_done(now, rid, ids, TransferMode.PUSH, i + 1, now)
        post = next(e for e in core.drain() if isinstance(e, Post))
        core.transfer_ended(now, post.key, XferEnd.DONE)
        core.drain()
        now += step
        core.tick(now)
        core.drain()
        lat.append(time.perf_counter() - t0)
    held = len(core._requests)
    out = {**_stats(lat), "timer_entries": len(core._timers), "records_held": held,
           "tracked_per_record": (_tracked() - tracked0) / max(held, 1)}
    core.close(now)
    return out


def _consumer(requests: int, step: float) -> dict[str, Any]:
    mine, links = _sides()
    core = ConsumerCore(mine.layout, ConsumerCoreConfig(), links)
    core.peer_up(0.0, PEER)
    ids = np.arange(BLOCKS, dtype=np.int64)
    now, lat = 0.0, []
    for i in range(requests):
        rid = f"c{i}"
        t0 = time.perf_counter()
        core.expect(now, rid, ids, [PEER], 60.0, 1, False, [1], i + 1)
        core.drain()
        core.on_message(now, PEER, m.Posted(rid, i + 1, 0))
        core.on_notification(now, PEER, m.Landed(rid, i + 1, 0, nbytes=BLOCKS * 128))
        core.drain()
        now += step
        core.tick(now)
        core.drain()
        lat.append(time.perf_counter() - t0)
    out = {**_stats(lat), "timer_entries": len(core._timers), "pending": core.pending}
    core.close(now)
    core.drain()
    return out


def measure(requests: int = 150_000, rate: float = 1000.0, collect: bool = True,
            progress: bool = True) -> dict[str, Any]:
    """``requests`` through each core at ``rate`` per simulated second; ``collect``
    False runs with the garbage collector off (what the rest of the tail is)."""
    if requests < 2 or rate <= 0:
        raise ValueError("core_stream needs requests >= 2 and rate > 0")
    was = gc.isenabled()
    (gc.enable if collect else gc.disable)()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        t0 = time.perf_counter()
        producer = _producer(requests, 1.0 / rate)
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if progress:
            print(f"[core_stream] producer core: {requests} requests in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        consumer = _consumer(requests, 1.0 / rate)
    finally:
        (gc.enable if was else gc.disable)()
    producer["peak_rss_growth_mib"] = (rss1 - rss0) / 1024
    return {"requests": requests, "rate": rate, "gc": collect, "producer": producer,
            "consumer": consumer}


def run(quick: bool, progress: bool = True, requests: int | None = None) -> dict[str, Any]:
    """The suite: :func:`measure` with the library's timeouts at 1,000 requests per simulated
    second; ``requests`` through each core (default 150,000, two minutes of tombstones;
    20,000 when ``quick``)."""
    out = measure(requests or (20_000 if quick else 150_000), progress=progress)
    summary: dict[str, Any] = {}
    for side in ("producer", "consumer"):
        for key in ("us_p50", "us_p99", "us_max", "timer_entries"):
            summary[f"core_{side}_{key}"] = out[side][key]
    summary["core_producer_tracked_per_record"] = out["producer"]["tracked_per_record"]
    summary["core_producer_peak_rss_growth_mib"] = out["producer"]["peak_rss_growth_mib"]
    return {**out, "summary": summary}


def table(out: dict[str, Any]) -> str:
    cols = ("us_p50", "us_p99", "us_p999", "us_max", "timer_entries")
    lines = [f"{out['requests']} requests at {out['rate']:.0f}/s simulated, garbage "
             f"collector {'on' if out['gc'] else 'off'}",
             "| core | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for side in ("producer", "consumer"):
        r = out[side]
        lines.append(f"| {side} | " + " | ".join(f"{r[c]:,.0f}" for c in cols) + " |")
    p = out["producer"]
    lines.append(f"producer: {p['records_held']:,} records held (tombstones), "
                 f"{p['tracked_per_record']:.1f} tracked objects each, peak RSS "
                 f"+{p['peak_rss_growth_mib']:.0f} MiB")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=150_000)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = measure(args.requests, args.rate, not args.no_gc)
    print(table(out))
    save_json(out, args.json)


if __name__ == "__main__":
    main()
