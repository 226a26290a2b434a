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

``python -m benchmarks.hot_path [--requests N] [--gap S] [--evict MIB] [--busy KIND]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import multiprocessing.connection as mpc
import threading
import time
from typing import Any

import numpy as np

from ._common import RawAgent, descriptor_table, evictor, open_endpoint, pct, save_json
from ._procs import Worker, stop_all

__all__ = ["run"]

_M = "benchmarks.hot_path:"
NUM_BLOCKS = 1024
GAP_S = 0.002
SIZES = (1, 16, 256)         # blocks per request (x 16 regions x 4 KiB: 64 KiB, 1, 16 MiB)
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
               address: str = "") -> dict[str, Any]:
    import kvpush

    from .critical_path import _make_cache

    buffers, layout = _make_cache(NUM_BLOCKS)
    state.update(buffers=buffers, layout=layout)
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
    from .critical_path import BLOCK_BYTES

    raw: RawAgent = state["raw"]
    peer = raw.add_peer(md)
    state["raw_local"] = raw.prep("NIXL_INIT_AGENT", descriptor_table(
        [int(b.ctypes.data) for b in state["buffers"]], NUM_BLOCKS, BLOCK_BYTES))
    state["raw_remote"] = raw.prep(peer, descriptor_table(bases, NUM_BLOCKS, BLOCK_BYTES))
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


def run(requests: int = 40, busy: str = "", gap_s: float = GAP_S,
        evict_mib: int = 0) -> dict[str, Any]:
    """``busy``: also run a busy thread in each engine process (``python`` or ``numpy``, as
    :mod:`benchmarks.busy_engine` does). ``evict_mib``: the prefill process copies that many
    MiB right before each request, kvpush's and raw NIXL's alike (as the throughput suite's
    memcpy and raw transfers leave kvpush's requests with cold caches)."""
    evictor(evict_mib)   # a bad value fails here, before any process starts
    prefill, decode = Worker("hp-prefill"), Worker("hp-decode")
    rows = []
    try:
        a = prefill.call(_M + "side_setup", role="prefill")
        b = decode.call(_M + "side_setup", role="decode", address=a["address"], timeout=60)
        prefill.call(_M + "side_raw_connect", md=b["raw_md"], bases=b["bases"])
        decode.call(_M + "side_raw_connect", md=a["raw_md"], bases=a["bases"])
        if busy:
            for w in (prefill, decode):
                w.call("benchmarks.busy_engine:side_busy", on=True, kind=busy)
        rng = np.random.default_rng(0)
        n = 0
        for blocks in SIZES:
            src = rng.choice(NUM_BLOCKS, blocks, replace=False).astype(np.int64)
            dst = rng.choice(NUM_BLOCKS, blocks, replace=False).astype(np.int64)
            rids = [f"hp-{n + i}" for i in range(requests + 1)]
            n += len(rids)
            decode.call("benchmarks.busy_engine:side_expect", rids=rids, ids=dst)
            prefill.call(_M + "side_take")
            decode.call(_M + "side_take")
            decode.send_call(_M + "side_wait_results", rids=rids)
            times = prefill.call(_M + "side_push", rids=rids, ids=src, gap_s=gap_s,
                                 evict_mib=evict_mib, timeout=300)
            results = decode.result(120)
            pst = prefill.call(_M + "side_take")
            cst = decode.call(_M + "side_take")
            # raw NIXL, same descriptors kvpush posts (region-major, by local id)
            order = np.argsort(src, kind="stable")
            regions = 16
            li = (np.arange(regions)[:, None] * NUM_BLOCKS + src[order][None, :]).ravel()
            ri = (np.arange(regions)[:, None] * NUM_BLOCKS + dst[order][None, :]).ravel()
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
            row: dict[str, Any] = {"blocks": blocks, "bytes": blocks * regions * 4096,
                                   "requests": requests}
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


def table(rows: list[dict[str, Any]]) -> str:
    cols = ([f"p_{s}" for s in PRODUCER_STAGES] + ["p_engine"]
            + [f"c_{s}" for s in CONSUMER_STAGES] + ["c_finished", "c_engine", "c_polls",
                                                      "raw_done", "raw_notif"])
    head = "| bytes | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        lines.append(f"| {r['bytes'] >> 10} KiB | " + " | ".join(
            f"{r.get(c, float('nan')):.0f}" for c in cols) + " |")
    return "\n".join(lines)


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
    args = ap.parse_args()
    out = run(args.requests, args.busy, args.gap, args.evict)
    print(table(out["rows"]))
    save_json(out, args.json)


if __name__ == "__main__":
    main()
