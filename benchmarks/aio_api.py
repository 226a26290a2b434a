"""``python -m benchmarks.aio_api [--requests N] [--repeat R]``: the engine-facing API's
overhead, side by side in one process (issue 18).

Per round, the same N push requests (one block each, both endpoints in this process) are
driven four ways, in turn: threads (``expect`` + ``prefill_done`` per request, then
``handle.wait``), asyncio (``await`` every handle), uvloop (the same), and batches
(``expect_many`` + ``prefill_done_many``, then ``await``). It prints requests per second
(median of the rounds) and each way's ratio to threads, then the CPU an ``async for`` over
``consumer.results()`` burns while nothing comes (it waits on ``fileno()``: it should be
nothing). Figures are ratios of one run on whatever host runs it; compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import uvloop

import kvpush


def _cache(num_blocks: int) -> kvpush.KVLayout:
    bufs = [np.zeros((num_blocks, 2 * 4 * 2 * 16 * 2), np.uint8) for _ in range(2)]
    _cache.keep.append(bufs)  # type: ignore[attr-defined]
    return kvpush.KVLayout.from_buffers(bufs, num_layers=2, num_blocks=num_blocks,
                                        tokens_per_block=4, num_kv_heads=2, head_size=16,
                                        dtype="float16", kv_packed=True)


_cache.keep = []  # type: ignore[attr-defined]


def _threads(p: kvpush.Producer, c: kvpush.Consumer, name: str, n: int, tag: str) -> None:
    handles = [c.expect(f"{tag}-{i}", [i], name) for i in range(n)]
    for i in range(n):
        p.prefill_done(f"{tag}-{i}", [i])
    assert all(h.wait(60).ok for h in handles)


async def _awaited(p: kvpush.Producer, c: kvpush.Consumer, name: str, n: int,
                   tag: str) -> None:
    handles = [c.expect(f"{tag}-{i}", [i], name) for i in range(n)]
    for i in range(n):
        p.prefill_done(f"{tag}-{i}", [i])
    results = await asyncio.wait_for(asyncio.gather(*handles), 60)
    assert all(r.ok for r in results)


async def _batched(p: kvpush.Producer, c: kvpush.Consumer, name: str, n: int,
                   tag: str) -> None:
    handles = c.expect_many([(f"{tag}-{i}", [i], name) for i in range(n)])
    p.prefill_done_many([(f"{tag}-{i}", [i]) for i in range(n)])
    results = await asyncio.wait_for(asyncio.gather(*handles), 60)  # type: ignore[arg-type]
    assert all(r.ok for r in results)


def _settle(p: kvpush.Producer, c: kvpush.Consumer, n: int) -> None:
    got = 0
    deadline = time.monotonic() + 30
    while got < n and time.monotonic() < deadline:
        got += len(p.get_released())
        time.sleep(0.001)
    c.get_finished()


def _idle_cpu(c: kvpush.Consumer, seconds: float) -> float:
    async def watch() -> None:
        async for _ in c.results():
            pass

    async def main() -> float:
        task = asyncio.get_running_loop().create_task(watch())
        t0 = time.process_time()
        await asyncio.sleep(seconds)
        used = time.process_time() - t0
        task.cancel()
        return used

    return asyncio.run(main())


def run(n: int, repeat: int) -> dict[str, Any]:
    with kvpush.Producer(_cache(n)) as p, kvpush.Consumer(_cache(n)) as c:
        name = c.connect(p.address)
        ways: dict[str, Callable[[str], None]] = {
            "threads": lambda tag: _threads(p, c, name, n, tag),
            "asyncio": lambda tag: asyncio.run(_awaited(p, c, name, n, tag)),
            "uvloop": lambda tag: uvloop.run(_awaited(p, c, name, n, tag)),
            "batch+asyncio": lambda tag: asyncio.run(_batched(p, c, name, n, tag)),
        }
        rates: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(repeat + 1):          # round 0 warms up, not counted
            for way, fn in ways.items():
                t0 = time.perf_counter()
                fn(f"{way}-{r}")
                elapsed = time.perf_counter() - t0
                _settle(p, c, n)
                if r:
                    rates[way].append(n / elapsed)
        idle = _idle_cpu(c, 1.0)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"requests": n, "rounds": repeat, "req_per_s": med,
            "ratio_to_threads": {k: v / med["threads"] for k, v in med.items()},
            "idle_cpu_s_per_s": idle}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    out = run(args.requests, args.repeat)
    print(f"{out['requests']} push requests per round, median of {out['rounds']} rounds")
    for way, rate in out["req_per_s"].items():
        print(f"  {way:14s} {rate:9.0f} req/s   x{out['ratio_to_threads'][way]:.2f}")
    print(f"  async for results(), nothing arriving: {out['idle_cpu_s_per_s'] * 1e3:.1f} ms "
          f"CPU per s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
