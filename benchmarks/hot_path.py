"""Where one push's time goes, stage by stage, beside raw NIXL on the same buffers.

Two spawned engine processes (a prefill one with a :class:`kvpush.Producer`, a decode one
with a :class:`kvpush.Consumer`), kvpush's stage stamps on (:mod:`kvpush._trace`; off,
they cost one attribute test each). Requests run one at a time, ``GAP_S`` apart; per
request every stamp is taken as microseconds since the engine called ``prefill_done`` (one
monotonic clock for both processes), and each column is the median over the requests of
the first such stamp after the call:

* prefill process: ``queued`` (the engine's thread queued the hold and returns),
  ``woke`` (the loop thread's poll returned), ``command`` (the loop runs the hold),
  ``drained`` (the protocol core has handled it: its effects are drained), ``sent`` (a
  control frame is out: the ``Posted`` hint, sent before the WRITE), ``post`` /
  ``posted`` (NIXL's ``make_prepped_xfer`` + ``transfer`` called / returned),
  ``xfer_end`` (NIXL says DONE), ``release`` (on_release runs), ``engine`` (the engine's
  thread waiting on that callback woke);
* decode process: ``message`` (the ``Posted`` hint handled), ``notif`` (the WRITE's NIXL
  notification read), ``result`` (on_finished runs), ``engine`` (a thread of the decode
  engine waiting on it woke); ``polls``: NIXL polls from the hint to the notification.

Raw NIXL beside it, on the same bytes and descriptors (the agents configured as kvpush's):
``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` back-to-back at the initiator
(``raw_done``), and the target polling ``get_new_notifs`` back-to-back until the WRITE's
notification (``raw_notif``): the fastest a consumer can learn of a landing.

``--evict MIB``: each request, kvpush's and raw NIXL's, runs right after a numpy copy of
that many MiB in the prefill process, which leaves the caches cold, as an engine's forward
pass or the throughput suite's memcpy and raw transfers do.

``--shape``: ``layers`` (default) is the critical-path benchmark's cache, 16 regions (8
layers, K and V apart) of 4 KiB blocks, requests of 1, 16 and 256 blocks (64 KiB, 1 MiB,
16 MiB; 16 to 4,096 descriptors); ``sweep`` is the throughput suite's worst ``>= 1 MiB``
row, one region of 1 MiB blocks, 16 per request (16 MiB in 16 descriptors).

Beside the stamps, the time each thread spent *runnable but waiting for a CPU* during
kvpush's requests (Linux's per-thread ``schedstat``), per request, by thread: each side's
engine thread, its kvpush loop, ZeroMQ's I/O threads and the rest. On a host with as many
busy threads as cores, a thread woken while another runs a long copy can wait for it to end,
while the other core sits idle; this says how much of a stage that was.

``python -m benchmarks.hot_path [--requests N] [--gap S] [--evict MIB] [--busy KIND]
[--shape layers|sweep] [--json PATH]``
"""

from __future__ import annotations

import argparse
import math
import multiprocessing.connection as mpc
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._common import (
    MIB,
    RawAgent,
    descriptor_table,
    evictor,
    open_endpoint,
    pct,
    save_json,
    single_region_layout,
)
from ._procs import Worker, run_queue_waits, stop_all
from .critical_path import BLOCK_BYTES, REGIONS, _make_cache

__all__ = ["measure", "run", "table"]

NAME = "hot_path"
DESCRIPTION = ("One push at a time, stage by stage from kvpush's own stamps, beside raw NIXL on "
               "the same descriptors, and each thread's wait for a CPU")
SUMMARY_KEYS: dict[str, str] = {
    "hot_path_release_us_{size}":
        "prefill_done -> the prefill engine's thread woke on the release, p50 us (size: "
        "64kib, 1mib, 16mib)",
    "hot_path_ready_us_{size}": "prefill_done -> the decode engine's thread woke on READY, p50 us",
    "hot_path_raw_nixl_us_{size}": "raw NIXL's WRITE of the same descriptors, post -> DONE, p50 us",
    "hot_path_over_raw_nixl_us_{size}": "the release's p50 minus raw NIXL's: kvpush's cost, us",
    "hot_path_core_us_{size}":
        "the producer's protocol core handling prefill_done on the loop thread, p50 us",
    "hot_path_hint_us_{size}": "the Posted hint's send before the WRITE, p50 us",
    "hot_path_run_queue_us_{size}":
        "time every thread of both processes was runnable but waiting for a CPU, us per "
        "request (NaN where the kernel keeps no schedstat)",
}

_M = "benchmarks.hot_path:"
GAP_S = 0.002


@dataclass(frozen=True)
class Shape:
    """The KV cache both sides hold, and the requests pushed through it."""

    regions: int
    num_blocks: int
    block_bytes: int        # per region
    sizes: tuple[int, ...]  # blocks per request


SHAPES = {
    # critical_path's cache (8 layers, K and V apart, 4 KiB blocks): 64 KiB .. 16 MiB
    "layers": Shape(REGIONS, 1024, BLOCK_BYTES, (1, 16, 256)),
    "sweep": Shape(1, 64, MIB, (16,)),               # the throughput suite's 1 MiB x 16 row
}
#: The threads whose run-queue waits are reported, by side (see :func:`side_run_queue`).
THREADS = ("engine", "loop", "zmq", "other")
PRODUCER_STAGES = ("queued", "woke", "command", "drained", "sent", "post", "posted",
                   "xfer_end", "release")
CONSUMER_STAGES = ("message", "notif", "result")


def _trace() -> Any:
    """kvpush's stage stamps, or None for a kvpush without them (an older tree run for a
    before/after comparison: then only the benchmark's own stamps are reported)."""
    try:
        from kvpush import _trace as trace
    except ImportError:
        return None
    return trace


def side_setup(state: dict[str, Any], conn: mpc.Connection, role: str,
               address: str = "", shape: str = "layers") -> dict[str, Any]:
    import kvpush

    sh = SHAPES[shape]
    if sh.regions == REGIONS and sh.block_bytes == BLOCK_BYTES:
        buffers, layout = _make_cache(sh.num_blocks)
    elif sh.regions == 1:
        buffers = [np.zeros(sh.num_blocks * sh.block_bytes, dtype=np.uint8)]
        layout = single_region_layout(buffers[0], sh.block_bytes)
    else:
        raise ValueError(f"shape {shape!r}: no cache of that form")
    state.update(buffers=buffers, layout=layout, shape=sh,
                 engine_tid=threading.get_native_id())
    raw = RawAgent(f"hp-raw-{role}", "kvpush")
    raw.register(buffers)
    state["raw"] = raw
    state["cleanup"].append(raw.close)
    out: dict[str, Any] = {"raw_md": raw.metadata(),
                           "bases": [int(b.ctypes.data) for b in buffers]}
    if role == "prefill":
        released: dict[str, threading.Event] = {}

        def on_release(release: kvpush.Release) -> None:
            released.setdefault(release.request_id, threading.Event()).set()

        state["released"] = released
        out["address"] = open_endpoint(state, role, layout, on_release=on_release)
    else:
        done: dict[str, threading.Event] = {}
        finished: dict[str, int] = {}

        def on_finished(result: kvpush.TransferResult) -> None:
            finished[result.request_id] = time.monotonic_ns()
            done.setdefault(result.request_id, threading.Event()).set()

        state.update(done=done, finished=finished)
        open_endpoint(state, role, layout, address, on_finished=on_finished)
    trace = _trace()
    if trace is not None:
        trace.enable()
        state["cleanup"].append(lambda: trace.enable(False))
    return out


def side_raw_connect(state: dict[str, Any], conn: mpc.Connection, md: bytes,
                     bases: list[int]) -> str:
    sh: Shape = state["shape"]
    raw: RawAgent = state["raw"]
    peer = raw.add_peer(md)
    state["raw_local"] = raw.prep("NIXL_INIT_AGENT", descriptor_table(
        [int(b.ctypes.data) for b in state["buffers"]], sh.num_blocks, sh.block_bytes))
    state["raw_remote"] = raw.prep(peer, descriptor_table(bases, sh.num_blocks,
                                                          sh.block_bytes))
    state["raw_peer"] = peer
    return peer


def side_push(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
              ids: np.ndarray, gap_s: float = GAP_S, evict_mib: int = 0
              ) -> list[tuple[int, int]]:
    """prefill_done each request in turn, ``gap_s`` apart (0: each as soon as the previous
    one's release woke this thread), each right after an ``evict_mib`` MiB copy;
    (called, engine woke) ns each."""
    producer = state["endpoint"]
    evict = evictor(evict_mib)
    out = []
    for rid in rids:
        ev = state["released"].setdefault(rid, threading.Event())
        if gap_s:
            time.sleep(gap_s)
        evict()
        called = time.monotonic_ns()
        producer.prefill_done(rid, ids)
        if not ev.wait(30):
            raise TimeoutError(f"{rid}: not released in 30 s")
        out.append((called, time.monotonic_ns()))
    return out


def side_wait_results(state: dict[str, Any], conn: mpc.Connection, rids: list[str]
                      ) -> list[tuple[int, int]]:
    """A decode-engine thread waiting for each request's result in turn; (on_finished ran,
    this thread woke) ns each."""
    out = []
    for rid in rids:
        if not state["done"].setdefault(rid, threading.Event()).wait(60):
            raise TimeoutError(f"{rid}: no result in 60 s")
        out.append((state["finished"][rid], time.monotonic_ns()))
    return out


def side_run_queue(state: dict[str, Any], conn: mpc.Connection) -> dict[str, int] | None:
    """Nanoseconds this process's threads have spent runnable but not running, summed by
    kind (:data:`THREADS`: the engine thread that runs the benchmark's calls, the kvpush
    endpoint's loop, ZeroMQ's I/O threads, the rest); None where Linux keeps no such
    counts."""
    waits = run_queue_waits()
    if waits is None:
        return None
    loop = state["endpoint"]._driver.thread.native_id
    out = dict.fromkeys(THREADS, 0)
    for tid, (name, ns) in waits.items():
        kind = ("engine" if tid == state["engine_tid"] else "loop" if tid == loop
                else "zmq" if name.startswith("ZMQbg") else "other")
        out[kind] += ns
    return out


def side_take(state: dict[str, Any], conn: mpc.Connection) -> list[tuple[str, int]]:
    trace = _trace()
    return [] if trace is None else list(trace.take())


def side_raw_listen(state: dict[str, Any], conn: mpc.Connection, count: int
                    ) -> list[int]:
    """Poll NIXL's notifications back-to-back until ``count`` arrived; when each did."""
    agent = state["raw"].agent
    out: list[int] = []
    deadline = time.monotonic() + 120
    while len(out) < count and time.monotonic() < deadline:
        notifs = agent.get_new_notifs()
        if notifs:
            now = time.monotonic_ns()
            out.extend(now for notes in notifs.values() for _ in notes)
    return out


def side_raw_write(state: dict[str, Any], conn: mpc.Connection, local: np.ndarray,
                   remote: np.ndarray, count: int, evict_mib: int = 0
                   ) -> list[tuple[int, int]]:
    """``count`` raw WRITEs with a notification, GAP_S apart, each right after an
    ``evict_mib`` MiB copy as kvpush's requests; (posted, DONE) ns each."""
    raw: RawAgent = state["raw"]
    agent = raw.agent
    evict = evictor(evict_mib)
    out = []
    for i in range(count):
        time.sleep(GAP_S)
        evict()
        t0 = time.monotonic_ns()
        handle = agent.make_prepped_xfer("WRITE", state["raw_local"], local,
                                         state["raw_remote"], remote, f"raw-{i}".encode())
        st = agent.transfer(handle)
        while st != "DONE":
            if st == "ERR":
                raise RuntimeError("raw WRITE failed")
            st = agent.check_xfer_state(handle)
        out.append((t0, time.monotonic_ns()))
        handle.release()
    return out


def _firsts(stamps: list[tuple[str, int]], start: int, end: int, names: tuple[str, ...]
            ) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, t in stamps:
        if start <= t < end and name in names and name not in out:
            out[name] = (t - start) / 1e3
    return out


def measure(requests: int = 40, busy: str = "", gap_s: float = GAP_S,
            evict_mib: int = 0, shape: str = "layers") -> dict[str, Any]:
    """``busy``: also run a busy thread in each engine process (``python`` or ``numpy``, as
    :mod:`benchmarks.busy_engine` does). ``evict_mib``: the prefill process copies that many
    MiB right before each request, kvpush's and raw NIXL's alike (as the throughput suite's
    memcpy and raw transfers leave kvpush's requests with cold caches). ``shape``: a key of
    :data:`SHAPES`."""
    evictor(evict_mib)   # bad values fail here, before any process starts
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    sh = SHAPES[shape]
    prefill, decode = Worker("hp-prefill"), Worker("hp-decode")
    rows = []
    try:
        a = prefill.call(_M + "side_setup", role="prefill", shape=shape)
        b = decode.call(_M + "side_setup", role="decode", address=a["address"], shape=shape,
                        timeout=60)
        prefill.call(_M + "side_raw_connect", md=b["raw_md"], bases=b["bases"])
        decode.call(_M + "side_raw_connect", md=a["raw_md"], bases=a["bases"])
        if busy:
            for w in (prefill, decode):
                w.call("benchmarks.busy_engine:side_busy", on=True, kind=busy)
        rng = np.random.default_rng(0)
        n = 0
        for blocks in sh.sizes:
            src = rng.choice(sh.num_blocks, blocks, replace=False).astype(np.int64)
            dst = rng.choice(sh.num_blocks, blocks, replace=False).astype(np.int64)
            rids = [f"hp-{n + i}" for i in range(requests + 1)]
            n += len(rids)
            decode.call("benchmarks.busy_engine:side_expect", rids=rids, ids=dst)
            prefill.call(_M + "side_take")
            decode.call(_M + "side_take")
            waits0 = [w.call(_M + "side_run_queue") for w in (prefill, decode)]
            decode.send_call(_M + "side_wait_results", rids=rids)
            times = prefill.call(_M + "side_push", rids=rids, ids=src, gap_s=gap_s,
                                 evict_mib=evict_mib, timeout=300)
            results = decode.result(120)
            waits1 = [w.call(_M + "side_run_queue") for w in (prefill, decode)]
            pst = prefill.call(_M + "side_take")
            cst = decode.call(_M + "side_take")
            # raw NIXL, same descriptors kvpush posts (region-major, by local id)
            order = np.argsort(src, kind="stable")
            region = np.arange(sh.regions)[:, None] * sh.num_blocks
            li = (region + src[order][None, :]).ravel()
            ri = (region + dst[order][None, :]).ravel()
            decode.send_call(_M + "side_raw_listen", count=requests + 1)
            raw = prefill.call(_M + "side_raw_write", local=li.astype(np.int32),
                               remote=ri.astype(np.int32), count=requests + 1,
                               evict_mib=evict_mib, timeout=300)
            heard = decode.result(120)
            per: dict[str, list[float]] = {}
            polls: list[float] = []
            for i, (called, woke) in enumerate(times):
                if i == 0:
                    continue  # warms
                per.setdefault("p_engine", []).append((woke - called) / 1e3)
                per.setdefault("c_finished", []).append((results[i][0] - called) / 1e3)
                per.setdefault("c_engine", []).append((results[i][1] - called) / 1e3)
                end = times[i + 1][0] if i + 1 < len(times) else called + 10**12
                for k, v in _firsts(pst, called, end, PRODUCER_STAGES).items():
                    per.setdefault(f"p_{k}", []).append(v)
                c = _firsts(cst, called, end, CONSUMER_STAGES)
                for k, v in c.items():
                    per.setdefault(f"c_{k}", []).append(v)
                if "message" in c and "notif" in c:
                    lo, hi = called + c["message"] * 1e3, called + c["notif"] * 1e3
                    polls.append(sum(1 for nm, t in cst if nm == "poll" and lo <= t <= hi))
            row: dict[str, Any] = {"blocks": blocks,
                                   "bytes": blocks * sh.regions * sh.block_bytes,
                                   "requests": requests}
            for side, w0, w1 in zip("pc", waits0, waits1, strict=True):
                for kind in THREADS:   # us per request (the warm-up request included)
                    row[f"{side}_rq_{kind}"] = (float("nan") if w0 is None or w1 is None
                                                else (w1[kind] - w0[kind]) / 1e3 / len(rids))
            for k, vals in per.items():
                row[k] = pct(vals, 50)
            row["c_polls"] = pct(polls, 50) if polls else float("nan")
            row["raw_done"] = pct([(d - p) / 1e3 for p, d in raw[1:]], 50)
            row["raw_notif"] = pct([(h - p) / 1e3 for (p, _), h in zip(raw[1:], heard[1:],
                                                                        strict=False)], 50)
            rows.append(row)
    finally:
        stop_all([decode, prefill])
    return {"rows": rows}


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20}mib" if nbytes >= MIB else f"{nbytes >> 10}kib"


def run(quick: bool, progress: bool = True, requests: int | None = None) -> dict[str, Any]:
    """The suite: :func:`measure` on the critical path's cache (64 KiB, 1 MiB and 16 MiB
    pushes), ``requests`` per size (default 10 when ``quick``, else 40)."""
    out = measure(requests=requests or (10 if quick else 40))
    summary: dict[str, Any] = {}
    for row in out["rows"]:
        size = _size(row["bytes"])
        summary[f"hot_path_release_us_{size}"] = row["p_engine"]
        summary[f"hot_path_ready_us_{size}"] = row["c_engine"]
        summary[f"hot_path_raw_nixl_us_{size}"] = row["raw_done"]
        summary[f"hot_path_over_raw_nixl_us_{size}"] = row["p_engine"] - row["raw_done"]
        summary[f"hot_path_core_us_{size}"] = (row.get("p_drained", math.nan)
                                               - row.get("p_command", math.nan))
        summary[f"hot_path_hint_us_{size}"] = (row.get("p_sent", math.nan)
                                               - row.get("p_drained", math.nan))
        summary[f"hot_path_run_queue_us_{size}"] = sum(
            row[f"{side}_rq_{kind}"] for side in "pc" for kind in THREADS)
    return {**out, "summary": summary}


def _markdown(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    lines = ["| bytes | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r['bytes'] >> 10} KiB | " + " | ".join(
            f"{r.get(c, float('nan')):.0f}" for c in cols) + " |")
    return lines


def table(result: dict[str, Any]) -> str:
    """The stamps' medians and the run-queue waits of a :func:`measure` or :func:`run`."""
    rows = result["rows"]
    cols = ([f"p_{s}" for s in PRODUCER_STAGES] + ["p_engine"]
            + [f"c_{s}" for s in CONSUMER_STAGES] + ["c_finished", "c_engine", "c_polls",
                                                      "raw_done", "raw_notif"])
    waits = [f"{side}_rq_{kind}" for side in "pc" for kind in THREADS]
    title = ("Runnable but waiting for a CPU, us per kvpush request (p_: prefill process, "
             "c_: decode process)")
    return "\n".join([*_markdown(rows, cols), "", title, "", *_markdown(rows, waits)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--json", default="")
    ap.add_argument("--busy", choices=("", "python", "numpy"), default="")
    ap.add_argument("--gap", type=float, default=GAP_S,
                    help="seconds between a release and the next prefill_done (0: none, as "
                         "the throughput suite's back-to-back requests)")
    ap.add_argument("--evict", type=int, default=0, metavar="MIB",
                    help="copy MIB MiB right before each request, kvpush's and raw NIXL's "
                         "(cold caches, as in the throughput suite; default 0)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="layers",
                    help="layers: 4 KiB blocks in 16 regions, 64 KiB to 16 MiB requests "
                         "(default); sweep: the throughput suite's 1 MiB x 16 row")
    args = ap.parse_args()
    out = measure(args.requests, args.busy, args.gap, args.evict, args.shape)
    print(table(out))
    save_json(out, args.json)


if __name__ == "__main__":
    main()
