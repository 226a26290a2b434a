"""Handover into an engine that steps without pause while it waits for KV (vLLM's empty steps).

vLLM's engine core steps as long as it has unfinished requests; a decode instance whose
only requests wait for their KV runs steps with no forward pass back to back -- its
scheduler and the connector's calls, pure Python that never blocks. kvpush's loop thread in
that process then wins the GIL only when CPython's switch interval (5 ms) forces a hand-off,
on every wake-up a transfer needs. ``AdapterConfig.idle_yield_s`` makes such a step sleep a
moment while kvpush has something pending; this measures what that buys.

Two processes: a prefill engine with a :class:`kvpush.Producer`, and a decode engine whose
thread, after each request is registered (push) or pulled, steps like vLLM's empty steps
(~100 us of bytecode, then ``get_finished()``) until the request's result comes, sleeping
``yield_s`` after each step or not at all. Push: ``prefill_done`` called -> the result seen by
the engine's thread; pull: ``pull`` called -> the same. Yield settings take turns request by
request, so a loaded host slows them alike.

``python -m benchmarks.spinning_engine [--quick]``: p50 / p90 per mode and setting, and the
ratio of the yielding p50 and p90 to the spinning ones.
"""

from __future__ import annotations

import json
import multiprocessing.connection as mpc
import sys
import time
from typing import Any

import numpy as np

from ._common import open_endpoint, pct
from ._procs import Worker, stop_all

__all__ = ["run"]

_M = "benchmarks.spinning_engine:"
REQUEST_BLOCKS = 16       # 16 blocks x 16 regions x 4 KiB = 1 MiB
YIELDS = (0.0, 50e-6)     # no yield (vLLM as it is), the adapter's default


def side_setup(state: dict[str, Any], conn: mpc.Connection, role: str, num_blocks: int,
               address: str = "") -> str:
    import kvpush

    from .critical_path import _make_cache

    buffers, layout = _make_cache(num_blocks)
    state["buffers"] = buffers
    config = kvpush.ProducerConfig(lease_s=60.0) if role == "prefill" else None
    return open_endpoint(state, role, layout, address, config=config)


def side_prefill(state: dict[str, Any], conn: mpc.Connection, rid: str, ids: np.ndarray,
                 mode: str) -> Any:
    """Push: ``prefill_done`` now, returns when (monotonic); pull: returns a ticket."""
    import kvpush

    producer = state["endpoint"]
    for _ in producer.get_released():
        pass
    if mode == "pull":
        return producer.prefill_done(rid, ids, kvpush.TransferMode.PULL).to_bytes()
    t = time.monotonic()
    producer.prefill_done(rid, ids, kvpush.TransferMode.PUSH)
    return t


def side_expect(state: dict[str, Any], conn: mpc.Connection, rid: str, ids: np.ndarray) -> None:
    state["endpoint"].expect(rid, ids, state["producer"], timeout=30)


def _steps_until_result(consumer: Any, yield_s: float, timeout: float = 30.0) -> float:
    """vLLM's empty steps until a result comes; returns when it was seen (monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = 0
        for i in range(3000):   # the scheduler's and the connector's Python (~100 us)
            s += i
        if consumer.get_finished():
            return time.monotonic()
        if yield_s:
            time.sleep(yield_s)
    raise TimeoutError("no result within the timeout")


def side_wait(state: dict[str, Any], conn: mpc.Connection, yield_s: float) -> float:
    return _steps_until_result(state["endpoint"], yield_s)


def side_pull(state: dict[str, Any], conn: mpc.Connection, ticket: bytes, ids: np.ndarray,
              yield_s: float) -> float:
    import kvpush

    consumer = state["endpoint"]
    t0 = time.monotonic()
    consumer.pull(kvpush.PullTicket.from_bytes(ticket), ids, timeout=30)
    return _steps_until_result(consumer, yield_s) - t0


def run(quick: bool, requests: int | None = None) -> dict[str, Any]:
    requests = requests or (20 if quick else 60)
    num_blocks = 1024
    prefill, decode = Worker("se-prefill"), Worker("se-decode")
    samples: dict[tuple[str, float], list[float]] = {}
    try:
        address = prefill.call(_M + "side_setup", role="prefill", num_blocks=num_blocks)
        decode.call(_M + "side_setup", role="decode", num_blocks=num_blocks, address=address)
        rng = np.random.default_rng(0)
        src = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        dst = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        for i in range(requests + 1):
            for y in YIELDS:
                rid = f"push-{i}-{y}"
                decode.call(_M + "side_expect", rid=rid, ids=dst)
                decode.send_call(_M + "side_wait", yield_s=y)
                time.sleep(0.002)    # the decode engine is stepping when the prefill ends
                called = prefill.call(_M + "side_prefill", rid=rid, ids=src, mode="push")
                seen = decode.result(60)
                ticket = prefill.call(_M + "side_prefill", rid=f"pull-{i}-{y}", ids=src,
                                      mode="pull")
                took = decode.call(_M + "side_pull", ticket=ticket, ids=dst, yield_s=y,
                                   timeout=60)
                if i:  # the first round warms both paths up
                    samples.setdefault(("push", y), []).append(seen - called)
                    samples.setdefault(("pull", y), []).append(took)
    finally:
        stop_all([decode, prefill])
    rows = []
    summary: dict[str, Any] = {}
    for mode in ("push", "pull"):
        spin, calm = samples[(mode, YIELDS[0])], samples[(mode, YIELDS[1])]
        row = {"mode": mode, "requests": len(spin),
               "spinning_p50_ms": pct(spin, 50) * 1e3, "spinning_p90_ms": pct(spin, 90) * 1e3,
               "yielding_p50_ms": pct(calm, 50) * 1e3, "yielding_p90_ms": pct(calm, 90) * 1e3}
        row["p50_yielding_over_spinning"] = row["yielding_p50_ms"] / row["spinning_p50_ms"]
        row["p90_yielding_over_spinning"] = row["yielding_p90_ms"] / row["spinning_p90_ms"]
        summary[f"spinning_engine_p90_yield_over_spin_{mode}"] = \
            row["p90_yielding_over_spinning"]
        rows.append(row)
    return {"yield_s": YIELDS[1], "request_bytes": REQUEST_BLOCKS * 16 * 4096, "rows": rows,
            "summary": summary}


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    for r in result["rows"]:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
