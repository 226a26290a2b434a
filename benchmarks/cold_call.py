"""kvpush's per-request Python, hot and with the CPU caches evicted.

The throughput suite runs every kvpush request right after a memcpy and a raw NIXL transfer
of the same bytes (up to 16 MiB), as an engine runs its hand-over right after a forward
pass: kvpush's Python then starts with its code and objects out of the caches. This times
the protocol core's part of one push -- what the producer's loop thread runs for it: a
consumer's registration, ``prefill_done``, the WRITE's post, its end and the release (the
:class:`~kvpush.protocol.producer.ProducerCore` calls of ``benchmarks.core_stream``, no
threads, sockets or NIXL) -- after each of these, the samples taking turns:

* ``hot``: right after the same calls for another request;
* ``sleep``: after a 2 ms sleep (the host's wake penalty, ``host_wake_*`` in the suite);
* ``memcpy N MiB``: right after a numpy copy of N MiB, which evicts the caches.

Beside it, for contrast, one compiled call: ``kvpush._core.check_block_ids`` on the same
16 ids. One process, a few seconds.

``python -m benchmarks.cold_call [--samples N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpush import _core
from kvpush import messages as m
from kvpush.protocol.effects import Post, XferEnd
from kvpush.protocol.producer import CoreConfig, ProducerCore
from kvpush.request import TransferMode

from ._common import evictor, pct, save_json
from .core_stream import BLOCKS, PEER, _sides

__all__ = ["run"]

COPIES_MIB = (4, 32)


def run(samples: int = 300, copies_mib: tuple[int, ...] = COPIES_MIB) -> dict[str, Any]:
    """p50 microseconds of each piece after each preparation (module doc)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    preps: dict[str, Callable[[], object]] = {"hot": lambda: None,
                                              "sleep": lambda: time.sleep(0.002)}
    for n in copies_mib:
        preps[f"memcpy {n} MiB"] = evictor(n)

    mine, links = _sides()
    core = ProducerCore(mine.layout, CoreConfig(), links)
    core.peer_up(0.0, PEER, mine.layout)
    ids = np.arange(BLOCKS, dtype=np.int64)
    enc = m.encode_ids(ids)
    serial = itertools.count(1)
    clock = [0.0]     # the core's simulated time, a millisecond per push

    def push() -> float:
        """The core's calls for one push; seconds."""
        n, now = next(serial), clock[0]
        rid = f"cold-{n}"
        t0 = time.perf_counter()
        core.on_message(now, PEER, m.Register(rid, n, enc, 0, 60.0))
        core.drain()
        core.prefill_done(now, rid, ids, TransferMode.PUSH, n, now)
        post = next(e for e in core.drain() if isinstance(e, Post))
        core.transfer_ended(now, post.key, XferEnd.DONE)
        core.drain()
        dt = time.perf_counter() - t0
        clock[0] = now + 1e-3
        return dt

    def compiled() -> float:
        t0 = time.perf_counter()
        _core.check_block_ids(ids, mine.layout.num_blocks, "ids")
        return time.perf_counter() - t0

    calls = {"core: one push": push, "check_block_ids": compiled}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for i in range(samples + 1):
            for prep_name, prep in preps.items():
                for call_name, call in calls.items():
                    if prep_name == "hot":
                        call()       # untimed: the timed call runs right after it
                    else:
                        prep()
                    dt = call()
                    if i:            # the first round warms
                        times.setdefault((call_name, prep_name), []).append(dt)
    finally:
        core.close(clock[0])
    rows = []
    for name in calls:
        row: dict[str, Any] = {"call": name}
        for prep_name in preps:
            row[prep_name] = pct(times[(name, prep_name)], 50) * 1e6
        row["worst_over_hot"] = max(row[c] for c in preps) / row["hot"]
        rows.append(row)
    return {"samples": samples, "preparations": list(preps), "rows": rows}


def table(out: dict[str, Any]) -> str:
    cols = out["preparations"]
    lines = ["| call (p50 us) | " + " | ".join(cols) + " | worst / hot |",
             "|" + "---|" * (len(cols) + 2)]
    for r in out["rows"]:
        lines.append(f"| {r['call']} | " + " | ".join(f"{r[c]:.1f}" for c in cols)
                     + f" | {r['worst_over_hot']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = run(args.samples)
    print(table(out))
    save_json(out, args.json)


if __name__ == "__main__":
    main()
