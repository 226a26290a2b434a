"""Handover inside a busy engine: the same push and pull requests with and without a busy
Python thread in each engine process.

An engine's worker process is never only kvpush: its own threads run Python (the model
runner, a scheduler, tokenizers). kvpush's loop thread must win the GIL back every time it
wakes (a command, a message, a poll of NIXL), and a thread that runs Python without pause
gives it up only when CPython's switch interval (``sys.getswitchinterval()``, 5 ms by
default) forces it. So every GIL hand-off on kvpush's path can cost up to a switch interval
once the engine is busy, where it costs microseconds when it is idle.

Two processes (a prefill engine with a :class:`kvpush.Producer`, a decode engine with a
:class:`kvpush.Consumer`), each optionally running one *busy thread*: a pure-Python loop
that never blocks (the worst case: it releases the GIL only when forced). Conditions take
turns round by round (idle, busy, idle, busy, ...) so a loaded host slows both alike.

* **push** handover: ``prefill_done`` called (prefill process) -> READY reported by the
  consumer (its ``on_finished`` callback), one monotonic clock for both processes; the
  consumer registered the request beforehand (``expect``);
* **pull** handover: ``Consumer.pull`` called -> READY (callback), on a ticket issued
  beforehand.

Three conditions take turns: ``idle``; ``python`` (the busy thread runs bytecode without
pause: the worst case); ``numpy`` (the busy thread runs small matrix products back to back,
as a thread running tensor ops does, letting go of the GIL inside each). Reported: p50 / p90
per mode and condition, ``handover_busy_engine_over_idle`` (python busy p50 over idle p50,
push and pull together as a geometric mean) and ``handover_busy_numpy_engine_over_idle``;
then the same again with a 0.5 ms switch interval in both engines (``..._switch_0_5ms``):
an engine may set ``sys.setswitchinterval`` for itself; kvpush never changes it.

Beside them, under the same conditions, two **hand-off floors** (no kvpush, no NIXL):

* ``floor`` (in the prefill process): the engine's thread hands an empty job to a second
  Python thread sleeping between jobs (:class:`benchmarks._common.HandoffHelper`) and waits
  to be woken when it ran -- two wake-ups of a sleeping Python thread of one process;
* ``floor_x`` (across the two processes, a push's shape): the prefill engine's thread hands
  a one-byte datagram to its sleeping helper thread, which sends it to the decode process,
  where a Python thread sleeping in ``recv`` wakes and stamps it -- timed from the hand-off
  to that stamp, one monotonic clock for both.

A push or a pull needs at least ``floor_x``'s wake-ups (kvpush's loop thread on the side
that posts, a thread of the other engine to learn of the landing), so a design that
delivers its results to Python cannot have a busy/idle ratio under that floor's:
``handoff_floor_busy_over_idle`` and ``handoff_floor_busy_numpy_over_idle`` (``floor_x``),
``handoff_floor_local_busy_over_idle`` (``floor``). And in microseconds rather than ratios:
``handover_busy_added_over_floor_{push,pull}``, what the busy thread adds to kvpush's
handover p50 over what it adds to ``floor_x``'s (1: kvpush waits exactly as long for the
GIL as the floor does).
"""

from __future__ import annotations

import math
import multiprocessing.connection as mpc
import os
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from ._common import HandoffHelper, Progress, geomean, open_endpoint, pct
from ._procs import Worker, stop_all

__all__ = ["run"]

NAME = "busy_engine"
DESCRIPTION = ("Push and pull handover with a busy Python or numpy thread in each engine "
               "process, beside two hand-off floors")
SUMMARY_KEYS: dict[str, str] = {
    "handover_busy_engine_over_idle":
        "handover p50 with a pure-Python busy thread over idle, push and pull (geometric mean)",
    "handover_busy_numpy_engine_over_idle": "the same with a numpy busy thread",
    "handover_busy_engine_over_idle_{mode}": "the pure-Python ratio for push or pull alone",
    "handover_busy_numpy_engine_over_idle_{mode}": "the numpy ratio for push or pull alone",
    "handoff_floor_busy_over_idle": "the cross-process floor (floor_x) busy over idle",
    "handoff_floor_busy_numpy_over_idle": "floor_x with a numpy busy thread over idle",
    "handoff_floor_local_busy_over_idle": "the in-process floor busy over idle",
    "handoff_floor_local_busy_numpy_over_idle":
        "the in-process floor, numpy busy thread, over idle",
    "handover_p50_{condition}_{mode}_us":
        "kvpush's handover p50 per condition (idle, python, numpy) and mode, us",
    "handover_busy_added_over_floor_{mode}":
        "what the busy thread adds to kvpush's p50 over what it adds to floor_x's (1: exactly "
        "the floor's wait)",
    "handoff_floor_p50_{condition}_us": "floor_x's p50 per condition, us",
    "handoff_floor_local_p50_{condition}_us": "the in-process floor's p50 per condition, us",
    "{key}_switch_0_5ms":
        "the busy/idle ratios above again with a 0.5 ms switch interval in both engines",
}

_M = "benchmarks.busy_engine:"
REQUEST_BLOCKS = 16      # blocks per request: 16 x 16 regions x 4 KiB = 1 MiB
GAP_S = 0.002            # idle between requests, as between an engine's requests
SHORT_SWITCH_S = 5e-4    # the second pass's switch interval


def _cache(num_blocks: int) -> tuple[list[np.ndarray], Any]:
    from .critical_path import _make_cache

    return _make_cache(num_blocks)


def side_setup(state: dict[str, Any], conn: mpc.Connection, role: str, num_blocks: int,
               address: str = "", switch_interval_s: float | None = None) -> str:
    import kvpush

    if switch_interval_s is not None:  # what an engine process may set for itself
        sys.setswitchinterval(switch_interval_s)

    buffers, layout = _cache(num_blocks)
    state.update(buffers=buffers, layout=layout)
    if role == "prefill":
        released: dict[str, threading.Event] = {}
        lock = threading.Lock()

        def event(rid: str) -> threading.Event:
            with lock:
                return released.setdefault(rid, threading.Event())

        def on_release(release: kvpush.Release) -> None:
            event(release.request_id).set()

        state["released"] = event
        return open_endpoint(state, role, layout, on_release=on_release)
    ready: dict[str, float] = {}
    done: dict[str, threading.Event] = {}

    def on_finished(result: kvpush.TransferResult) -> None:
        ready[result.request_id] = time.monotonic()
        done.setdefault(result.request_id, threading.Event()).set()

    state.update(ready=ready, done=done)
    return open_endpoint(state, role, layout, address, on_finished=on_finished)


def side_busy(state: dict[str, Any], conn: mpc.Connection, on: bool, kind: str = "python"
              ) -> None:
    """Start (or stop) this process's busy thread. ``python``: bytecode without pause
    (gives the GIL up only when forced); ``numpy``: small matrix products back to back (as
    a thread running tensor ops: it lets go of the GIL inside each)."""
    if on and "busy" not in state:
        stop = threading.Event()

        def spin() -> None:
            x = 0
            m = np.ones((96, 96))
            while not stop.is_set():
                if kind == "numpy":
                    m = m @ m
                    m /= m.max()
                    continue
                for _ in range(1000):
                    x += 1

        thread = threading.Thread(target=spin, name="busy-engine", daemon=True)
        thread.start()
        state["busy"] = (stop, thread)

        def halt() -> None:
            stop.set()
            thread.join(10)

        state["cleanup"].append(halt)
    elif not on and "busy" in state:
        stop, thread = state.pop("busy")
        stop.set()
        thread.join(10)


def side_expect(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
                ids: np.ndarray) -> None:
    consumer = state["endpoint"]
    for rid in rids:
        state["done"].setdefault(rid, threading.Event())
        consumer.expect(rid, ids, state["producer"], timeout=60)


def side_push(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
              ids: np.ndarray) -> list[float]:
    """prefill_done each request in turn; returns when each was called (monotonic)."""
    producer = state["endpoint"]
    called = []
    for rid in rids:
        ev = state["released"](rid)
        time.sleep(GAP_S)
        called.append(time.monotonic())
        producer.prefill_done(rid, ids)
        if not ev.wait(30):
            raise TimeoutError(f"{rid}: not released in 30 s")
    return called


def side_tickets(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
                 ids: np.ndarray) -> list[bytes]:
    import kvpush

    producer = state["endpoint"]
    return [producer.prefill_done(rid, ids, kvpush.TransferMode.PULL).to_bytes()
            for rid in rids]


def side_pull(state: dict[str, Any], conn: mpc.Connection, tickets: list[bytes],
              ids: np.ndarray) -> list[float]:
    """Pull each ticket in turn; returns the handover of each (pull called -> READY)."""
    consumer = state["endpoint"]
    out = []
    for ticket in tickets:
        time.sleep(GAP_S)
        t0 = time.monotonic()
        handle = consumer.pull(ticket, ids, timeout=60)
        result = handle.wait(30)
        if not result.ok:
            raise RuntimeError(f"pull failed: {result.state} {result.error}")
        rid = result.request_id
        if not state["done"].setdefault(rid, threading.Event()).wait(30):
            raise TimeoutError(f"{rid}: no callback")
        out.append(state["ready"][rid] - t0)
    return out


def side_ready(state: dict[str, Any], conn: mpc.Connection, rids: list[str]) -> list[float]:
    out = []
    for rid in rids:
        if not state["done"][rid].wait(30):
            raise TimeoutError(f"{rid}: not READY in 30 s")
        out.append(state["ready"][rid])
    return out


def side_floor(state: dict[str, Any], conn: mpc.Connection, count: int) -> list[float]:
    """``count`` hand-offs of an empty job to a sleeping helper thread and back, each after
    ``GAP_S`` idle as a request is; seconds each."""
    helper = _helper(state)
    out = []
    for _ in range(count):
        time.sleep(GAP_S)
        t0 = time.perf_counter()
        helper.run(_nothing)
        out.append(time.perf_counter() - t0)
    return out


def _helper(state: dict[str, Any]) -> HandoffHelper:
    """This process's sleeping helper thread, made on first use (stopped at cleanup)."""
    if "helper" not in state:
        state["helper"] = HandoffHelper()
        state["cleanup"].append(state["helper"].close)
    helper: HandoffHelper = state["helper"]
    return helper


def _nothing() -> None:
    return None


def side_floor_listen(state: dict[str, Any], conn: mpc.Connection) -> str:
    """Decode side of ``floor_x``: a Python thread sleeping in ``recv`` on a datagram
    socket stamps each arrival; returns the socket's (abstract) address."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = f"\0kvpush-busy-floor-{os.getpid()}-{id(sock)}"
    sock.bind(address)
    arrivals: list[float] = []
    state["floor_arrivals"] = arrivals

    def serve() -> None:
        while sock.recv(16) != b"stop":
            arrivals.append(time.monotonic())
        sock.close()

    thread = threading.Thread(target=serve, name="floor-listener", daemon=True)
    thread.start()

    def stop() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
            out.sendto(b"stop", address)
        thread.join(5.0)

    state["cleanup"].append(stop)
    return address


def side_floor_send(state: dict[str, Any], conn: mpc.Connection, address: str,
                    count: int) -> list[float]:
    """Prefill side of ``floor_x``: ``count`` datagrams, each handed to the helper thread
    after ``GAP_S`` idle; returns when each was handed over (monotonic)."""
    if "floor_sock" not in state:
        state["floor_sock"] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        state["cleanup"].append(state["floor_sock"].close)
    helper, sock = _helper(state), state["floor_sock"]

    def send() -> None:
        sock.sendto(b"x", address)

    out = []
    for _ in range(count):
        time.sleep(GAP_S)
        out.append(time.monotonic())
        helper.run(send)
    return out


def side_floor_arrivals(state: dict[str, Any], conn: mpc.Connection, count: int,
                        timeout: float = 30.0) -> list[float]:
    """The next ``count`` arrivals of ``floor_x`` (and forget them)."""
    arrivals: list[float] = state["floor_arrivals"]
    end = time.monotonic() + timeout
    while len(arrivals) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"floor_x: {len(arrivals)} of {count} datagrams in {timeout} s")
        time.sleep(0.001)
    out = arrivals[:count]
    del arrivals[:count]
    return out


CONDITIONS = ("idle", "python", "numpy")
MODES = ("push", "pull", "floor", "floor_x")   # the floors: module doc


def run(quick: bool, progress: bool = True, rounds: int | None = None,
        per_round: int | None = None, switch_interval_s: float | None = None,
        short_switch: bool = True) -> dict[str, Any]:
    """``switch_interval_s``: set CPython's switch interval in both engine processes (None:
    leave the default, 5 ms; then, with ``short_switch``, everything again at 0.5 ms)."""
    rounds = rounds or (3 if quick else 8)
    per_round = per_round or (10 if quick else 25)
    num_blocks = 1024
    bar = Progress("busy-engine", 1 + rounds * len(CONDITIONS), progress)
    prefill, decode = Worker("be-prefill"), Worker("be-decode")
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        address = prefill.call(_M + "side_setup", role="prefill", num_blocks=num_blocks,
                               switch_interval_s=switch_interval_s)
        decode.call(_M + "side_setup", role="decode", num_blocks=num_blocks,
                    address=address, switch_interval_s=switch_interval_s, timeout=60)
        rng = np.random.default_rng(0)
        src = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        dst = rng.choice(num_blocks, REQUEST_BLOCKS, replace=False)
        floor_address = decode.call(_M + "side_floor_listen")
        bar.step("engines up")
        n = 0
        for r in range(rounds):
            for cond in CONDITIONS:
                for w in (prefill, decode):
                    w.call(_M + "side_busy", on=False)
                    w.call(_M + "side_busy", on=cond != "idle", kind=cond)
                rids = [f"push-{n + i}" for i in range(per_round + 1)]
                decode.call(_M + "side_expect", rids=rids, ids=dst)
                called = prefill.call(_M + "side_push", rids=rids, ids=src, timeout=300)
                ready = decode.call(_M + "side_ready", rids=rids, timeout=300)
                # request 0 of each batch warms (connection state, first wake-up)
                samples.setdefault(("push", cond), []).extend(
                    b - a for a, b in list(zip(called, ready, strict=True))[1:])
                prids = [f"pull-{n + i}" for i in range(per_round + 1)]
                tickets = prefill.call(_M + "side_tickets", rids=prids, ids=src)
                pulls = decode.call(_M + "side_pull", tickets=tickets, ids=dst, timeout=300)
                samples.setdefault(("pull", cond), []).extend(pulls[1:])
                floors = prefill.call(_M + "side_floor", count=per_round + 1, timeout=300)
                samples.setdefault(("floor", cond), []).extend(floors[1:])
                sent = prefill.call(_M + "side_floor_send", address=floor_address,
                                    count=per_round + 1, timeout=300)
                landed = decode.call(_M + "side_floor_arrivals", count=per_round + 1,
                                     timeout=300)
                samples.setdefault(("floor_x", cond), []).extend(
                    b - a for a, b in list(zip(sent, landed, strict=True))[1:])
                n += per_round + 1
                bar.step(f"round {r + 1} {cond}")
        for w in (prefill, decode):
            w.call(_M + "side_busy", on=False)
    finally:
        stop_all([decode, prefill])
        bar.finish()
    rows = []
    for mode in MODES:
        idle = samples[(mode, "idle")]
        row: dict[str, Any] = {"mode": mode, "requests": len(idle)}
        for cond in CONDITIONS:
            vals = samples[(mode, cond)]
            row[f"{cond}_p50_us"] = pct(vals, 50) * 1e6
            row[f"{cond}_p90_us"] = pct(vals, 90) * 1e6
            if cond != "idle":
                row[f"{cond}_over_idle"] = pct(vals, 50) / pct(idle, 50)
        rows.append(row)
    summary: dict[str, Any] = {}
    transfers, local, cross = rows[:2], rows[2], rows[3]
    for cond, key, cross_key, local_key in (
            ("python", "handover_busy_engine_over_idle", "handoff_floor_busy_over_idle",
             "handoff_floor_local_busy_over_idle"),
            ("numpy", "handover_busy_numpy_engine_over_idle",
             "handoff_floor_busy_numpy_over_idle", "handoff_floor_local_busy_numpy_over_idle")):
        ratio = geomean([r[f"{cond}_over_idle"] for r in transfers])
        summary[key] = ratio if math.isfinite(ratio) else math.nan
        for t in transfers:
            summary[f"{key}_{t['mode']}"] = t[f"{cond}_over_idle"]
        summary[cross_key] = cross[f"{cond}_over_idle"]
        summary[local_key] = local[f"{cond}_over_idle"]
    for t in transfers:
        for cond in CONDITIONS:
            summary[f"handover_p50_{cond}_{t['mode']}_us"] = t[f"{cond}_p50_us"]
    # What the busy thread adds to a handover (busy p50 - idle p50), over what it adds to
    # the cross-process floor: 1 when kvpush pays exactly the floor's extra wait.
    floor_added = cross["python_p50_us"] - cross["idle_p50_us"]
    for t in transfers:
        added = t["python_p50_us"] - t["idle_p50_us"]
        summary[f"handover_busy_added_over_floor_{t['mode']}"] = (
            added / floor_added if floor_added > 0 else math.nan)
    for cond in CONDITIONS:
        summary[f"handoff_floor_p50_{cond}_us"] = cross[f"{cond}_p50_us"]
        summary[f"handoff_floor_local_p50_{cond}_us"] = local[f"{cond}_p50_us"]
    out: dict[str, Any] = {
        "request_bytes": REQUEST_BLOCKS * 16 * 4096,
        "switch_interval_s": (sys.getswitchinterval() if switch_interval_s is None
                              else switch_interval_s),
        "rows": rows,
        "summary": summary,
    }
    if switch_interval_s is None and short_switch:
        # The same with a 0.5 ms switch interval in both engines: how much of the busy
        # engine's cost is the interval kvpush's loop thread waits to win the GIL back.
        short = run(quick, progress, rounds, per_round, switch_interval_s=SHORT_SWITCH_S)
        out["short_switch"] = short
        for key in ("handover_busy_engine_over_idle", "handover_busy_numpy_engine_over_idle",
                    "handoff_floor_busy_over_idle", "handoff_floor_busy_numpy_over_idle",
                    "handoff_floor_local_busy_over_idle"):
            summary[f"{key}_switch_0_5ms"] = short["summary"][key]
    return out
