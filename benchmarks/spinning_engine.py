"""Handover into an engine that steps without pause while it waits for KV (vLLM's empty steps).

vLLM's engine core steps as long as it has unfinished requests; a decode instance whose
only requests wait for their KV runs steps with no forward pass back to back -- its
scheduler and the connector's calls, pure Python that never blocks. kvpush's loop thread in
that process then wins the GIL only when CPython's switch interval (5 ms) forces a hand-off,
on every wake-up a transfer needs. ``AdapterConfig.idle_yield_s`` makes such a step wait
while kvpush has something pending -- until a result is queued (the consumer's descriptor) or
the bound passes; this measures what that buys, beside the fixed 50 us sleep per step the
adapter took before (seventh session).

Two processes: a prefill engine with a :class:`kvpush.Producer`, and a decode engine whose
thread, after each request is registered (push) or pulled, steps like vLLM's empty steps
(~100 us of bytecode, then ``get_finished()``) until the request's result comes: back to
back (``spin``, vLLM as it is), sleeping 50 us after each (``sleep``), or waiting on the
consumer's descriptor for up to 1 ms (``wait``: the adapter's wait, at a longer bound than
its default). Push: ``prefill_done`` called -> the result seen by the engine's thread; pull:
``pull`` called -> the same. The
policies take turns request by request, so a loaded host slows them alike. Also: the engine
thread's CPU time per request while it waited.

``python -m benchmarks.spinning_engine [--quick]``: p50 / p90 and CPU per mode and policy,
and the ratios of the waiting p50 and p90 to the spinning ones.
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
POLICIES = ("spin", "sleep", "wait")
SLEEP_S = 50e-6           # a fixed sleep per idle step (the adapter's default bound)
WAIT_S = 1e-3             # the wait's bound (AdapterConfig.idle_yield_s; its default is 50 us)


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


def _steps_until_result(consumer: Any, policy: str, timeout: float = 30.0
                        ) -> tuple[float, float]:
    """vLLM's empty steps until a result comes; returns when it was seen (monotonic) and
    the thread's CPU seconds meanwhile."""
    import select

    deadline = time.monotonic() + timeout
    cpu = time.thread_time()
    fd = consumer.fileno()
    while time.monotonic() < deadline:
        s = 0
        for i in range(3000):   # the scheduler's and the connector's Python (~100 us)
            s += i
        if consumer.get_finished():
            return time.monotonic(), time.thread_time() - cpu
        if policy == "sleep":
            time.sleep(SLEEP_S)
        elif policy == "wait":   # as vllm_worker._wait
            select.select([fd], [], [], WAIT_S)
    raise TimeoutError("no result within the timeout")


def side_wait(state: dict[str, Any], conn: mpc.Connection, policy: str
              ) -> tuple[float, float]:
    return _steps_until_result(state["endpoint"], policy)


def side_pull(state: dict[str, Any], conn: mpc.Connection, ticket: bytes, ids: np.ndarray,
              policy: str) -> tuple[float, float]:
    import kvpush

    consumer = state["endpoint"]
    t0 = time.monotonic()
    consumer.pull(kvpush.PullTicket.from_bytes(ticket), ids, timeout=30)
    seen, cpu = _steps_until_result(consumer, policy)
    return seen - t0, cpu


def run(quick: bool, requests: int | None = None) -> dict[str, Any]:
    requests = requests or (20 if quick else 60)
    num_blocks = 1024
    prefill, decode = Worker("se-prefill"), Worker("se-decode")
    samples: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    try:
        address = prefill.call(_M + "side_setup", role="prefill", num_blocks=num_blocks)
        decode.call(_M + "side_setup", role="decode", num_blocks=num_blocks, address=address)
        rng = np.random.default_rng(0)
        src = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        dst = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        for i in range(requests + 1):
            for policy in POLICIES:
                rid = f"push-{i}-{policy}"
                decode.call(_M + "side_expect", rid=rid, ids=dst)
                decode.send_call(_M + "side_wait", policy=policy)
                time.sleep(0.002)    # the decode engine is stepping when the prefill ends
                called = prefill.call(_M + "side_prefill", rid=rid, ids=src, mode="push")
                seen, push_cpu = decode.result(60)
                ticket = prefill.call(_M + "side_prefill", rid=f"pull-{i}-{policy}", ids=src,
                                      mode="pull")
                took, pull_cpu = decode.call(_M + "side_pull", ticket=ticket, ids=dst,
                                             policy=policy, timeout=60)
                if i:  # the first round warms both paths up
                    samples.setdefault(("push", policy), []).append(seen - called)
                    samples.setdefault(("pull", policy), []).append(took)
                    cpus.setdefault(("push", policy), []).append(push_cpu)
                    cpus.setdefault(("pull", policy), []).append(pull_cpu)
    finally:
        stop_all([decode, prefill])
    rows = []
    summary: dict[str, Any] = {}
    for mode in ("push", "pull"):
        row: dict[str, Any] = {"mode": mode, "requests": len(samples[(mode, "spin")])}
        for policy in POLICIES:
            row[f"{policy}_p50_ms"] = pct(samples[(mode, policy)], 50) * 1e3
            row[f"{policy}_p90_ms"] = pct(samples[(mode, policy)], 90) * 1e3
            row[f"{policy}_cpu_ms"] = pct(cpus[(mode, policy)], 50) * 1e3
        for policy in ("sleep", "wait"):
            for q in ("p50", "p90"):
                row[f"{q}_{policy}_over_spin"] = row[f"{policy}_{q}_ms"] / row[f"spin_{q}_ms"]
        summary[f"spinning_engine_p90_yield_over_spin_{mode}"] = row["p90_wait_over_spin"]
        rows.append(row)
    return {"wait_s": WAIT_S, "sleep_s": SLEEP_S, "request_bytes": REQUEST_BLOCKS * 16 * 4096,
            "rows": rows, "summary": summary}


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    for r in result["rows"]:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
