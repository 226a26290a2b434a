"""Transfer throughput, nixlbench-style, across two processes on the same buffers.

Side A (the prefill host) owns the source buffer, side B (the decode host) the destination
buffer; both are spawned workers. For every point of the sweep -- block size, blocks per
request, block order -- and both directions of control, on the very same bytes:

* ``memcpy``: numpy ``copyto`` of the request's byte count, contiguous, one thread, in A
  (the physical limit of one core moving those bytes);
* ``raw WRITE`` / ``raw READ``: NIXL used directly, ``prep_xfer_dlist`` once,
  ``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` polled back-to-back per
  request; A WRITEs into B, or B READs from A. The agents are configured as kvpush
  configures its own (progress thread off, ``ucx_error_handling_mode=none``) and are given
  the same descriptor indices kvpush posts (pairs ordered by local id), so the ratio
  isolates kvpush's own overhead;
* the hand-off floors, raw NIXL again with the thread hops of an engine integration and
  nothing else: ``raw ... handoff`` hands the whole raw transfer to a second thread of the
  process, which sleeps between requests as kvpush's loop thread does, and waits to be woken
  by it when the transfer is done (kvpush's shape: engine -> loop -> engine); ``raw ...
  inline`` posts on the caller's thread and hands only the polling to that thread (one hop,
  back). Whatever a design of that shape does, it costs at least these; kvpush's time over
  the floor is its own work;
* ``kvpush WRITE`` (push): B has registered the request (``Consumer.expect``); A times
  ``Producer.prefill_done`` -> the release of the source blocks (WRITE done at the
  initiator, as raw NIXL is timed); B then checks every request became READY;
* ``kvpush READ`` (pull): A hands out pull tickets; B times ``Consumer.pull`` -> READY.

Requests run one at a time (latency-bound at small sizes, bandwidth-bound at large ones);
each figure is the request's bytes over the median request time. The methods of a point take
turns request by request (memcpy, raw, kvpush, memcpy, raw, kvpush, ...), so slow phases of
a shared machine hit all of them alike. NIXL's
default configuration (progress thread on, error mode ``peer``) is measured in a separate
phase at the end, because its progress threads keep both cores busy while they exist.
"""

from __future__ import annotations

import math
import multiprocessing.connection as mpc
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.protocol.producer import waiting_ids_budget

from ._common import (
    KIB,
    MIB,
    HandoffHelper,
    Progress,
    RawAgent,
    block_ids,
    descriptor_table,
    fmt_bytes,
    geomean,
    single_region_layout,
    sorted_pairs,
    wake_penalty,
)
from ._procs import Worker, stop_all

__all__ = ["Point", "run", "sweep"]

NAME = "throughput"
DESCRIPTION = ("Transfer throughput across two processes on the same buffers: memcpy, raw NIXL, "
               "the hand-off floors and kvpush push (WRITE) / pull (READ)")
SUMMARY_KEYS: dict[str, str] = {
    "write_vs_raw_nixl": "kvpush WRITE GB/s over raw NIXL's, geometric mean over the sweep",
    "read_vs_raw_nixl": "kvpush READ GB/s over raw NIXL's, geometric mean over the sweep",
    "{op}_vs_raw_nixl_min": "the sweep's worst point of that ratio",
    "{op}_vs_raw_nixl_best": "the same ratio on each method's fastest request",
    "{op}_vs_raw_nixl_{size}":
        "the ratio over the points of that size (64kib: 64 KiB requests; 1mib_plus: >= 1 MiB; "
        "16mib_plus: >= 16 MiB)",
    "{op}_vs_raw_nixl_16mib_plus_best": "the >= 16 MiB ratio on the fastest requests",
    "kvpush_overhead_us_p50_{op}":
        "kvpush's fixed cost per request: its p50 minus raw NIXL's, median over the sweep, us",
    "{shape}_floor_us_p50_{op}":
        "the hand-off floor's (handoff or inline) p50 minus raw NIXL's, median over the sweep, "
        "us",
    "kvpush_over_handoff_floor_us_p50_{op}":
        "kvpush's p50 minus the handoff floor's: its own work, median over the sweep, us",
    "{op}_{shape}_floor_vs_raw_nixl_{size}": "the floor's GB/s over raw NIXL's at that size",
    "push_stage_{stage}_us_p50":
        "a push's stage (benchmarks.throughput.PUSH_STAGES, in_flight_extra: in flight minus raw "
        "NIXL), median over the sweep, us",
    "pull_stage_engine_call_us_p50":
        "the engine's thread inside Consumer.pull, median over the sweep, us",
    "{op}_vs_memcpy_1mib": "kvpush GB/s over memcpy's at 1 MiB x 16 scattered",
    "memcpy_gbps_1mib": "numpy memcpy GB/s at that point",
    "coalesce_point":
        "the point the coalescing keys come from (smallest blocks in runs, largest request)",
    "coalesced_vs_uncoalesced_{op}": "kvpush GB/s with coalescing over without, at that point",
    "coalesced_vs_uncoalesced_raw_nixl_write":
        "raw NIXL given sorted over unsorted descriptors, same point: the ceiling",
    "raw_nixl_kvpush_config_vs_default_{op}":
        "raw NIXL in kvpush's configuration over NIXL's defaults (full runs only)",
    "host_wake_{figure}":
        "the host's wake penalty: a fixed piece of Python hot, after a 2 ms sleep, and the "
        "difference, us p50",
}

MAX_ITERS = 400
MIN_ITERS = 9

#: Where a push's time goes (kvpush's Release.timings, stamped on the producer, plus the
#: benchmark's own stamps around the engine's call), per request.
PUSH_STAGES = {
    "engine_call": "the engine's thread inside prefill_done (validation, hand-off queued)",
    "to_loop": "prefill_done called -> the loop thread took the blocks (hand-off to loop)",
    "prepare": "-> the WRITE's Post effect made (registration matched, plan, hint sent)",
    "in_flight": "-> NIXL reported it done (make_prepped_xfer + post + wire + progress)",
    "release": "-> source released (the on_release callback ran)",
    "wake_engine": "-> the engine's thread waiting on that callback woke",
}


def _floors(agent: RawAgent, helper: HandoffHelper, op: str, local: Any, li: np.ndarray,
            remote: Any, ri: np.ndarray) -> tuple[float, float]:
    """Seconds of one raw transfer handed to ``helper`` and back, then of one posted here
    and polled there (the hand-off floors of the module doc)."""
    def whole() -> None:
        agent.xfer(op, local, li, remote, ri)

    t0 = time.perf_counter()
    helper.run(whole)
    handoff = time.perf_counter() - t0
    t0 = time.perf_counter()
    handle, first = agent.post(op, local, li, remote, ri)

    def poll() -> None:
        agent.wait(op, handle, first, t0)

    helper.run(poll)
    return handoff, time.perf_counter() - t0


@dataclass(frozen=True)
class Point:
    block_bytes: int
    blocks: int
    order: str
    coalesce_check: bool = False   # also run kvpush with coalescing off here

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.blocks

    @property
    def label(self) -> str:
        return f"{fmt_bytes(self.block_bytes)} x {self.blocks} {self.order}"


def sweep(quick: bool) -> tuple[list[Point], int]:
    """The points to measure and the buffer size per side."""
    if quick:
        pts = [
            Point(4 * KIB, 16, "scattered"),
            Point(4 * KIB, 4096, "in_order"),
            Point(4 * KIB, 4096, "scattered"),
            Point(4 * KIB, 4096, "runs", coalesce_check=True),
            Point(64 * KIB, 256, "scattered"),
            Point(1 * MIB, 16, "scattered"),
        ]
        return pts, 64 * MIB
    pts = []
    for bs in (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB):
        for n in (1, 16, 256, 4096):
            if bs * n > 64 * MIB or n > (256 * MIB // bs) // 4:
                continue
            for order in ("in_order", "scattered", "runs"):
                if n == 1 and order != "in_order":
                    continue
                pts.append(Point(bs, n, order, coalesce_check=(order == "runs" and n >= 256)))
        # the fixed-bytes line of the plot: 16 MiB per request at every block size
        n16 = 16 * MIB // bs
        if all(not (p.block_bytes == bs and p.blocks == n16) for p in pts) and n16 >= 1:
            pts.append(Point(bs, n16, "scattered"))
    pts.append(Point(4 * KIB, 4096, "runs_ordered", coalesce_check=True))
    return pts, 256 * MIB


# =========================================================================================
# Side functions (run in the workers)
# =========================================================================================
def side_init(state: dict[str, Any], conn: mpc.Connection, role: str, total_bytes: int
              ) -> int:
    buf = np.empty(total_bytes, dtype=np.uint8)
    if role == "A":
        buf[:] = (np.arange(total_bytes, dtype=np.uint32) % 251).astype(np.uint8)
    else:
        buf.fill(0)  # touch every page before anything is timed
    state["buf"] = buf
    state["role"] = role
    state["raw"] = {}
    state["dl"] = {}
    state["kv"] = {}
    return int(buf.ctypes.data)


def side_raw_create(state: dict[str, Any], conn: mpc.Connection, config: str) -> bytes:
    agent = RawAgent(f"raw-{config}-{state['role']}", config)
    agent.register([state["buf"]])
    state["raw"][config] = agent
    return agent.metadata()


def side_raw_connect(state: dict[str, Any], conn: mpc.Connection, config: str,
                     metadata: bytes) -> str:
    return state["raw"][config].add_peer(metadata)


def side_raw_prep(state: dict[str, Any], conn: mpc.Connection, config: str, peer: str,
                  block_bytes: int, peer_addr: int) -> None:
    agent: RawAgent = state["raw"][config]
    nb = state["buf"].nbytes // block_bytes
    local = agent.prep("NIXL_INIT_AGENT",
                       descriptor_table([state["buf"].ctypes.data], nb, block_bytes))
    remote = agent.prep(peer, descriptor_table([peer_addr], nb, block_bytes))
    state["dl"][(config, block_bytes)] = (local, remote)


def side_raw_run(state: dict[str, Any], conn: mpc.Connection, config: str, block_bytes: int,
                 op: str, local_idx: np.ndarray, remote_idx: np.ndarray, min_time: float,
                 poll_sleep: float = 0.0) -> list[float]:
    agent: RawAgent = state["raw"][config]
    local, remote = state["dl"][(config, block_bytes)]
    li, ri = local_idx.astype(np.int32), remote_idx.astype(np.int32)
    agent.xfer(op, local, li, remote, ri)  # warm: connection, rkeys, caches
    out: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(out) < 3 or (time.perf_counter() < t_end and len(out) < MAX_ITERS):
        out.append(agent.xfer(op, local, li, remote, ri, poll_sleep=poll_sleep))
    return out


def side_raw_close(state: dict[str, Any], conn: mpc.Connection, config: str) -> None:
    agent = state["raw"].pop(config, None)
    for key in [k for k in state["dl"] if k[0] == config]:
        del state["dl"][key]
    if agent is not None:
        agent.close()


class _Releases:
    """Release events of a Producer, by request id (set on its loop thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, threading.Event] = {}
        self.reasons: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}

    def event(self, rid: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault(rid, threading.Event())

    def __call__(self, release: Any) -> None:
        self.reasons[release.request_id] = release.reason.value
        self.timings[release.request_id] = dict(release.timings)
        self.event(release.request_id).set()


def side_kv_producer(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                     coalesce: bool, progress: dict[str, float] | None = None
                     ) -> tuple[str, str]:
    import kvpush

    layout = single_region_layout(state["buf"], block_bytes)
    releases = _Releases()
    cfg = kvpush.ProducerConfig(coalesce=coalesce, progress=kvpush.ProgressPolicy(
        **(progress or {})))
    producer = kvpush.Producer(layout, cfg, on_release=releases)
    state["kv"][(block_bytes, coalesce)] = (producer, releases)
    state["cleanup"].append(producer.close)
    return producer.address, producer.name


def side_kv_consumer(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                     coalesce: bool, address: str, progress: dict[str, float] | None = None
                     ) -> str:
    import kvpush

    layout = single_region_layout(state["buf"], block_bytes)
    cfg = kvpush.ConsumerConfig(coalesce=coalesce, progress=kvpush.ProgressPolicy(
        **(progress or {})))
    consumer = kvpush.Consumer(layout, cfg)
    state["cleanup"].append(consumer.close)
    name = consumer.connect(address, timeout=30)
    state["kv"][(block_bytes, coalesce)] = (consumer, {"producer": name, "handles": []})
    return name


def side_kv_close(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                  coalesce: bool) -> None:
    entry = state["kv"].pop((block_bytes, coalesce), None)
    if entry is not None:
        entry[0].close()
        state["cleanup"].remove(entry[0].close)


def side_kv_expect(state: dict[str, Any], conn: mpc.Connection, key: tuple[int, bool],
                   rids: list[str], dst_ids: np.ndarray) -> None:
    consumer, info = state["kv"][key]
    for rid in rids:
        info["handles"].append(consumer.expect(rid, dst_ids, info["producer"], timeout=60))


def side_kv_check(state: dict[str, Any], conn: mpc.Connection, key: tuple[int, bool],
                  timeout: float = 30.0) -> dict[str, int]:
    _, info = state["kv"][key]
    states: dict[str, int] = {}
    for h in info["handles"]:
        st = h.wait(timeout).state.value
        states[st] = states.get(st, 0) + 1
    info["handles"].clear()
    return states


def _wait_registrations(want: int, timeout: float) -> None:
    from kvpush.metrics import LIVE

    deadline = time.monotonic() + timeout
    while LIVE.snapshot().get("registrations_waiting", 0) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {LIVE.snapshot()} of {want} registrations arrived")
        time.sleep(0.0005)


def side_kv_tickets(state: dict[str, Any], conn: mpc.Connection, key: tuple[int, bool],
                    rids: list[str], src_ids: np.ndarray) -> list[bytes]:
    import kvpush

    producer, releases = state["kv"][key]
    out = []
    for rid in rids:
        releases.event(rid)
        ticket = producer.prefill_done(rid, src_ids, kvpush.TransferMode.PULL)
        out.append(ticket.to_bytes())
    return out


def side_kv_released(state: dict[str, Any], conn: mpc.Connection, key: tuple[int, bool],
                     rids: list[str], timeout: float = 30.0) -> None:
    _, releases = state["kv"][key]
    for rid in rids:
        if not releases.event(rid).wait(timeout):
            raise TimeoutError(f"{rid} not released")


def _sorted_or_not(local: np.ndarray, remote: np.ndarray, sort: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    a, b = sorted_pairs(local, remote) if sort else (local, remote)
    return a.astype(np.int32), b.astype(np.int32)


def side_write_interleaved(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                           src: np.ndarray, dst: np.ndarray, rids: dict[str, list[str]],
                           count: int) -> dict[str, list[float]]:
    """A: per request, in turn -- memcpy of the bytes, raw NIXL WRITE (pairs ordered by
    source id, as kvpush posts them), kvpush push; with ``"nocoalesce"`` rids also raw NIXL
    in list order and kvpush with coalescing off. Request 0 of each warms and is dropped."""
    agent: RawAgent = state["raw"]["kvpush"]
    local_h, remote_h = state["dl"][("kvpush", block_bytes)]
    nbytes = len(src) * block_bytes
    msrc = state["buf"][:nbytes]
    tmp = state.get("memcpy_dst")
    if tmp is None or tmp.nbytes < nbytes:
        tmp = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        tmp.fill(0)
        state["memcpy_dst"] = tmp
    mdst = tmp[:nbytes]
    li, ri = _sorted_or_not(src, dst, True)
    li_u, ri_u = _sorted_or_not(src, dst, False)
    _wait_registrations(sum(len(v) for v in rids.values()), 30.0)
    out: dict[str, list[float]] = {"memcpy": [], "raw_write": [], "kv_write": [],
                                   "raw_write_handoff": [], "raw_write_inline": []}
    if "nocoalesce" in rids:
        out.update(raw_write_listorder=[], kv_write_nocoalesce=[])

    stages: dict[str, list[float]] = {f"stage_{k}": [] for k in PUSH_STAGES}

    def push(key: tuple[int, bool], rid: str) -> float:
        producer, releases = state["kv"][key]
        ev = releases.event(rid)
        t0 = time.perf_counter()
        called = time.monotonic()
        producer.prefill_done(rid, src)
        returned = time.monotonic()
        if not ev.wait(30.0):
            raise TimeoutError(f"push {rid}: no release in 30 s")
        woke = time.monotonic()
        dt = time.perf_counter() - t0
        if releases.reasons.get(rid) != "transferred":
            raise RuntimeError(f"push {rid}: released {releases.reasons.get(rid)}")
        if key[1]:  # the coalescing endpoint: its Release's stamps, stage by stage
            st = releases.timings[rid]
            for name, value in (("engine_call", returned - called),
                                ("to_loop", st["held"] - st["prefill_done"]),
                                ("prepare", st["posted"] - st["held"]),
                                ("in_flight", st["written"] - st["posted"]),
                                ("release", st["released"] - st["written"]),
                                ("wake_engine", woke - st["released"])):
                stages[f"stage_{name}"].append(value)
        return dt

    helper = HandoffHelper()
    try:
        for i in range(count + 1):
            t0 = time.perf_counter()
            np.copyto(mdst, msrc)
            times = {"memcpy": time.perf_counter() - t0,
                     "raw_write": agent.xfer("WRITE", local_h, li, remote_h, ri),
                     "kv_write": push((block_bytes, True), rids["coalesce"][i])}
            times["raw_write_handoff"], times["raw_write_inline"] = _floors(
                agent, helper, "WRITE", local_h, li, remote_h, ri)
            if "nocoalesce" in rids:
                times["raw_write_listorder"] = agent.xfer("WRITE", local_h, li_u, remote_h,
                                                          ri_u)
                times["kv_write_nocoalesce"] = push((block_bytes, False), rids["nocoalesce"][i])
            if i:
                for k, v in times.items():
                    out[k].append(v)
            else:
                for stage in stages.values():
                    stage.clear()
    finally:
        helper.close()
    out.update(stages)
    return out


def side_read_interleaved(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                          src: np.ndarray, dst: np.ndarray, tickets: dict[str, list[bytes]],
                          count: int) -> dict[str, list[float]]:
    """B: per request, in turn -- raw NIXL READ (pairs ordered by destination id, as kvpush
    posts them), kvpush pull; with ``"nocoalesce"`` tickets also raw NIXL in list order and
    kvpush with coalescing off. Request 0 of each warms and is dropped."""
    agent: RawAgent = state["raw"]["kvpush"]
    local_h, remote_h = state["dl"][("kvpush", block_bytes)]
    li, ri = _sorted_or_not(dst, src, True)
    li_u, ri_u = _sorted_or_not(dst, src, False)
    out: dict[str, list[float]] = {"raw_read": [], "kv_read": [], "raw_read_handoff": [],
                                   "raw_read_inline": []}
    if "nocoalesce" in tickets:
        out.update(raw_read_listorder=[], kv_read_nocoalesce=[])

    calls: list[float] = []

    def pull(key: tuple[int, bool], ticket: bytes) -> float:
        consumer, _ = state["kv"][key]
        t0 = time.perf_counter()
        handle = consumer.pull(ticket, dst)
        if key[1]:
            calls.append(time.perf_counter() - t0)
        result = handle.wait(30.0)
        dt = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"pull failed: {result.state} {result.error}")
        return dt

    helper = HandoffHelper()
    try:
        for i in range(count + 1):
            times = {"raw_read": agent.xfer("READ", local_h, li, remote_h, ri),
                     "kv_read": pull((block_bytes, True), tickets["coalesce"][i])}
            times["raw_read_handoff"], times["raw_read_inline"] = _floors(
                agent, helper, "READ", local_h, li, remote_h, ri)
            if "nocoalesce" in tickets:
                times["raw_read_listorder"] = agent.xfer("READ", local_h, li_u, remote_h, ri_u)
                times["kv_read_nocoalesce"] = pull((block_bytes, False),
                                                   tickets["nocoalesce"][i])
            if i:
                for k, v in times.items():
                    out[k].append(v)
    finally:
        helper.close()
    out["stage_pull_call"] = calls[1:]
    return out


def side_raw_probe(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                   src: np.ndarray, dst: np.ndarray) -> float:
    """A: seconds of one raw WRITE of the request (after a warm one): sizes the loops."""
    agent: RawAgent = state["raw"]["kvpush"]
    local_h, remote_h = state["dl"][("kvpush", block_bytes)]
    li, ri = _sorted_or_not(src, dst, True)
    agent.xfer("WRITE", local_h, li, remote_h, ri)
    return min(agent.xfer("WRITE", local_h, li, remote_h, ri) for _ in range(3))


def side_check_bytes(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                     dst_ids: np.ndarray, src_ids: np.ndarray) -> bool:
    """B: the destination blocks hold the source blocks' pattern (A filled i % 251)."""
    buf = state["buf"]
    for d, s in list(zip(dst_ids, src_ids, strict=True))[:64]:
        got = buf[int(d) * block_bytes:(int(d) + 1) * block_bytes]
        start = int(s) * block_bytes
        want = ((np.arange(start, start + block_bytes, dtype=np.uint64) % 251)
                .astype(np.uint8))
        if not np.array_equal(got, want):
            return False
    return True


def side_clear(state: dict[str, Any], conn: mpc.Connection) -> None:
    state["buf"][: 1 << 20].fill(0)


# =========================================================================================
# Orchestration (parent)
# =========================================================================================
_M = "benchmarks.throughput:"


class _Pair:
    def __init__(self, total_bytes: int) -> None:
        self.a = Worker("tp-A")
        self.b = Worker("tp-B")
        self.addr_a = self.a.call(_M + "side_init", role="A", total_bytes=total_bytes)
        self.addr_b = self.b.call(_M + "side_init", role="B", total_bytes=total_bytes)
        self.total = total_bytes
        self.raw_peer: dict[str, tuple[str, str]] = {}

    def raw_setup(self, config: str) -> None:
        md_a = self.a.call(_M + "side_raw_create", config=config)
        md_b = self.b.call(_M + "side_raw_create", config=config)
        name_b = self.a.call(_M + "side_raw_connect", config=config, metadata=md_b)
        name_a = self.b.call(_M + "side_raw_connect", config=config, metadata=md_a)
        self.raw_peer[config] = (name_b, name_a)

    def raw_prep(self, config: str, block_bytes: int) -> None:
        name_b, name_a = self.raw_peer[config]
        self.a.call(_M + "side_raw_prep", config=config, peer=name_b, block_bytes=block_bytes,
                    peer_addr=self.addr_b)
        self.b.call(_M + "side_raw_prep", config=config, peer=name_a, block_bytes=block_bytes,
                    peer_addr=self.addr_a)

    def raw_close(self, config: str) -> None:
        self.a.call(_M + "side_raw_close", config=config)
        self.b.call(_M + "side_raw_close", config=config)

    def kv_setup(self, block_bytes: int, coalesce: bool) -> None:
        address, _ = self.a.call(_M + "side_kv_producer", block_bytes=block_bytes,
                                 coalesce=coalesce)
        self.b.call(_M + "side_kv_consumer", block_bytes=block_bytes, coalesce=coalesce,
                    address=address, timeout=60)

    def kv_close(self, block_bytes: int, coalesce: bool) -> None:
        self.b.call(_M + "side_kv_close", block_bytes=block_bytes, coalesce=coalesce)
        self.a.call(_M + "side_kv_close", block_bytes=block_bytes, coalesce=coalesce)

    def close(self) -> None:
        stop_all([self.b, self.a])


class _Runner:
    def __init__(self, pair: _Pair, min_time: float) -> None:
        self.pair = pair
        self.min_time = min_time
        self.seq = 0

    def raw(self, config: str, p: Point, op: str, src: np.ndarray, dst: np.ndarray,
            sort: bool = True, min_time: float | None = None) -> list[float]:
        """Raw NIXL, the pairs ordered by local id (what kvpush posts) or, with
        ``sort=False``, in list order (what a connector without a planner posts)."""
        order = sorted_pairs if sort else (lambda a, b: (a, b))
        if op == "WRITE":   # A initiates: local = source
            local, remote = order(src, dst)
            worker = self.pair.a
        else:               # B initiates: local = destination
            local, remote = order(dst, src)
            worker = self.pair.b
        dts: list[float] = worker.call(_M + "side_raw_run", config=config,
                                       block_bytes=p.block_bytes, op=op, local_idx=local,
                                       remote_idx=remote,
                                       min_time=self.min_time if min_time is None else min_time)
        return dts

    def _rids(self, count: int) -> list[str]:
        self.seq += 1
        return [f"t{self.seq}-{i}" for i in range(count)]

    def point(self, p: Point, src: np.ndarray, dst: np.ndarray, min_time: float
              ) -> dict[str, list[float]]:
        """Every method at one point, request by request in turn (see the module doc)."""
        a, b = self.pair.a, self.pair.b
        t_raw = a.call(_M + "side_raw_probe", block_bytes=p.block_bytes, src=src, dst=dst)
        # per request: memcpy + raw + kvpush (~ raw + fixed overhead) + the two hand-off
        # floors, both directions
        per = 9 * t_raw + 1000e-6
        if p.coalesce_check:
            per *= 2
        count = max(MIN_ITERS, min(MAX_ITERS, int(min_time / per)))
        # Every request is registered before the first is timed, and a producer keeps at
        # most waiting_ids_budget(the consumer's blocks) ids waiting from one consumer (the
        # rest are refused): as many requests as fit, at least MIN_ITERS.
        fit = waiting_ids_budget(self.pair.total // p.block_bytes) // p.blocks - 1
        count = max(min(count, fit), MIN_ITERS)
        modes = {"coalesce": True, **({"nocoalesce": False} if p.coalesce_check else {})}
        rids = {m: self._rids(count + 1) for m in modes}
        for m, c in modes.items():
            b.call(_M + "side_kv_expect", key=(p.block_bytes, c), rids=rids[m], dst_ids=dst)
        out: dict[str, list[float]] = a.call(
            _M + "side_write_interleaved", block_bytes=p.block_bytes, src=src, dst=dst,
            rids=rids, count=count, timeout=600)
        for c in modes.values():
            states = b.call(_M + "side_kv_check", key=(p.block_bytes, c), timeout=60)
            if states != {"ready": count + 1}:
                raise RuntimeError(f"push {p.label}: consumer states {states}")
        pull_rids = {m: self._rids(count + 1) for m in modes}
        tickets = {m: a.call(_M + "side_kv_tickets", key=(p.block_bytes, c), rids=pull_rids[m],
                             src_ids=src) for m, c in modes.items()}
        out.update(b.call(_M + "side_read_interleaved", block_bytes=p.block_bytes, src=src,
                          dst=dst, tickets=tickets, count=count, timeout=600))
        for m, c in modes.items():
            a.call(_M + "side_kv_released", key=(p.block_bytes, c), rids=pull_rids[m],
                   timeout=60)
        return out


def _gbps(nbytes: int, dts: list[float]) -> float:
    return nbytes / float(np.median(dts)) / 1e9 if dts else float("nan")


def run(quick: bool, progress: bool = True, points: list[Point] | None = None,
        total_bytes: int | None = None, min_time: float | None = None,
        default_config: bool = True) -> dict[str, Any]:
    pts, total = sweep(quick)
    points = points or pts
    total = total_bytes or total
    min_time = min_time if min_time is not None else (0.3 if quick else 0.6)
    sizes = sorted({p.block_bytes for p in points})
    steps = len(points) + len(sizes) + (len(points) if default_config else 0) + 2
    bar = Progress("throughput", steps, progress)
    pair = _Pair(total)
    results: dict[Point, dict[str, Any]] = {p: {"dts": {}} for p in points}
    try:
        pair.raw_setup("kvpush")
        runner = _Runner(pair, min_time)
        bar.step("agents up")
        wake = wake_penalty(60 if quick else 200)  # the workers wait on their pipes
        for bs in sizes:
            nb = total // bs
            here = [p for p in points if p.block_bytes == bs]
            pair.raw_prep("kvpush", bs)
            coalesce_modes = [True] + ([False] if any(p.coalesce_check for p in here) else [])
            for c in coalesce_modes:
                pair.kv_setup(bs, c)
            bar.step(f"{fmt_bytes(bs)} endpoints")
            for p in here:
                src, dst = block_ids(p.order, p.blocks, nb, nb, seed=p.blocks + bs)
                results[p]["dts"] = runner.point(p, src, dst, min_time)
                if not pair.b.call(_M + "side_check_bytes", block_bytes=bs, dst_ids=dst,
                                   src_ids=src):
                    raise AssertionError(f"{p.label}: destination bytes differ from source")
                bar.step(p.label)
            for c in coalesce_modes:
                pair.kv_close(bs, c)
        pair.raw_close("kvpush")
        if default_config:
            # NIXL defaults: progress threads poll without pause while the agents exist.
            pair.raw_setup("default")
            for bs in sizes:
                pair.raw_prep("default", bs)
                for p in (q for q in points if q.block_bytes == bs):
                    src, dst = block_ids(p.order, p.blocks, total // bs, total // bs,
                                         seed=p.blocks + bs)
                    dts = results[p]["dts"]
                    dts["raw_default_write"] = runner.raw("default", p, "WRITE", src, dst,
                                                          min_time=min_time / 4)
                    dts["raw_default_read"] = runner.raw("default", p, "READ", src, dst,
                                                         min_time=min_time / 4)
                    bar.step(f"default config {p.label}")
            pair.raw_close("default")
        bar.step("done")
    finally:
        pair.close()
        bar.finish()
    out = _summarize(points, results, total)
    out["wake"] = wake
    out["summary"].update({f"host_wake_{k}": v for k, v in wake.items()})
    return out


def _summarize(points: list[Point], results: dict[Point, dict[str, Any]], total: int
               ) -> dict[str, Any]:
    rows = []
    for p in points:
        dts = results[p]["dts"]
        row: dict[str, Any] = {"block_bytes": p.block_bytes, "blocks": p.blocks,
                               "order": p.order, "request_bytes": p.nbytes}
        for name, vals in dts.items():
            if name.startswith("stage_"):  # seconds per stage, not transfers
                row[f"{name}_us_p50"] = float(np.median(vals)) * 1e6 if vals else math.nan
                continue
            row[f"{name}_gbps"] = _gbps(p.nbytes, vals)
            row[f"{name}_best_gbps"] = p.nbytes / min(vals) / 1e9 if vals else float("nan")
            row[f"{name}_us_p50"] = float(np.median(vals)) * 1e6
            row[f"{name}_n"] = len(vals)
        row["write_vs_raw"] = row["kv_write_gbps"] / row["raw_write_gbps"]
        row["read_vs_raw"] = row["kv_read_gbps"] / row["raw_read_gbps"]
        row["write_vs_memcpy"] = row["kv_write_gbps"] / row["memcpy_gbps"]
        row["read_vs_memcpy"] = row["kv_read_gbps"] / row["memcpy_gbps"]
        # best-case ratios: the fastest request of each method (a busy host only adds time)
        row["write_vs_raw_best"] = row["kv_write_best_gbps"] / row["raw_write_best_gbps"]
        row["read_vs_raw_best"] = row["kv_read_best_gbps"] / row["raw_read_best_gbps"]
        row["write_overhead_us"] = row["kv_write_us_p50"] - row["raw_write_us_p50"]
        row["read_overhead_us"] = row["kv_read_us_p50"] - row["raw_read_us_p50"]
        for op in ("write", "read"):
            # the hand-off floors over raw NIXL, and kvpush over the (handoff) floor
            for shape in ("handoff", "inline"):
                row[f"{op}_{shape}_floor_us"] = (row[f"raw_{op}_{shape}_us_p50"]
                                                 - row[f"raw_{op}_us_p50"])
                row[f"{op}_{shape}_vs_raw"] = (row[f"raw_{op}_{shape}_gbps"]
                                               / row[f"raw_{op}_gbps"])
            row[f"{op}_over_handoff_floor_us"] = (row[f"kv_{op}_us_p50"]
                                                  - row[f"raw_{op}_handoff_us_p50"])
        # in flight beyond the raw transfer: NIXL calls and progress that raw NIXL also
        # makes are in raw_write's time; what is left is kvpush's polling
        row["stage_in_flight_extra_us_p50"] = (row.get("stage_in_flight_us_p50", math.nan)
                                               - row["raw_write_us_p50"])
        if "kv_write_nocoalesce_gbps" in row:
            row["coalesce_gain_write"] = row["kv_write_gbps"] / row["kv_write_nocoalesce_gbps"]
            row["coalesce_gain_read"] = row["kv_read_gbps"] / row["kv_read_nocoalesce_gbps"]
            # the same ratio for raw NIXL: what ordering the descriptors can gain at most
            row["coalesce_gain_raw_write"] = (row["raw_write_gbps"]
                                              / row["raw_write_listorder_gbps"])
            row["coalesce_gain_raw_read"] = row["raw_read_gbps"] / row["raw_read_listorder_gbps"]
        if "raw_default_write_gbps" in row:
            row["raw_kvpushcfg_vs_default_write"] = (row["raw_write_gbps"]
                                                     / row["raw_default_write_gbps"])
            row["raw_kvpushcfg_vs_default_read"] = (row["raw_read_gbps"]
                                                    / row["raw_default_read_gbps"])
        rows.append(row)

    def pick(bs: int, order: str | None = None) -> dict[str, Any] | None:
        cands = [r for r in rows if r["block_bytes"] == bs
                 and (order is None or r["order"] == order)]
        return max(cands, key=lambda r: r["request_bytes"]) if cands else None

    big = [r for r in rows if r["request_bytes"] >= 16 * MIB]
    mib_plus = [r for r in rows if r["request_bytes"] >= MIB]
    small = [r for r in rows if r["request_bytes"] == 64 * KIB]
    summary: dict[str, Any] = {
        "write_vs_raw_nixl": geomean([r["write_vs_raw"] for r in rows]),
        "read_vs_raw_nixl": geomean([r["read_vs_raw"] for r in rows]),
        "write_vs_raw_nixl_min": min(r["write_vs_raw"] for r in rows),
        "read_vs_raw_nixl_min": min(r["read_vs_raw"] for r in rows),
        "write_vs_raw_nixl_best": geomean([r["write_vs_raw_best"] for r in rows]),
        "read_vs_raw_nixl_best": geomean([r["read_vs_raw_best"] for r in rows]),
        "kvpush_overhead_us_p50_write": float(np.median([r["write_overhead_us"]
                                                         for r in rows])),
        "kvpush_overhead_us_p50_read": float(np.median([r["read_overhead_us"] for r in rows])),
    }
    for op in ("write", "read"):
        for shape in ("handoff", "inline"):
            summary[f"{shape}_floor_us_p50_{op}"] = float(np.median(
                [r[f"{op}_{shape}_floor_us"] for r in rows]))
        summary[f"kvpush_over_handoff_floor_us_p50_{op}"] = float(np.median(
            [r[f"{op}_over_handoff_floor_us"] for r in rows]))
    for name, sel in (("1mib_plus", mib_plus), ("64kib", small)):
        if sel:
            summary[f"write_vs_raw_nixl_{name}"] = geomean([r["write_vs_raw"] for r in sel])
            summary[f"read_vs_raw_nixl_{name}"] = geomean([r["read_vs_raw"] for r in sel])
            for op in ("write", "read"):
                for shape in ("handoff", "inline"):
                    summary[f"{op}_{shape}_floor_vs_raw_nixl_{name}"] = geomean(
                        [r[f"{op}_{shape}_vs_raw"] for r in sel])
    # per stage of a push (PUSH_STAGES), and the engine's pull() call: median over rows
    for stage in [*PUSH_STAGES, "in_flight_extra", "pull_call"]:
        vals = [r[f"stage_{stage}_us_p50"] for r in rows
                if math.isfinite(r.get(f"stage_{stage}_us_p50", math.nan))]
        if vals:
            summary[f"push_stage_{stage}_us_p50" if stage != "pull_call"
                    else "pull_stage_engine_call_us_p50"] = float(np.median(vals))
    if big:
        summary["write_vs_raw_nixl_16mib_plus"] = geomean([r["write_vs_raw"] for r in big])
        summary["read_vs_raw_nixl_16mib_plus"] = geomean([r["read_vs_raw"] for r in big])
        summary["write_vs_raw_nixl_16mib_plus_best"] = geomean(
            [r["write_vs_raw_best"] for r in big])
        summary["read_vs_raw_nixl_16mib_plus_best"] = geomean(
            [r["read_vs_raw_best"] for r in big])
    one_mib = pick(MIB, "scattered") or pick(MIB)
    if one_mib:
        summary["write_vs_memcpy_1mib"] = one_mib["write_vs_memcpy"]
        summary["read_vs_memcpy_1mib"] = one_mib["read_vs_memcpy"]
        summary["memcpy_gbps_1mib"] = one_mib["memcpy_gbps"]
    co = [r for r in rows if "coalesce_gain_write" in r and r["order"] == "runs"]
    if co:
        # smallest blocks (where the per-descriptor cost rules), largest request
        smallest = min(r["block_bytes"] for r in co)
        best = max((r for r in co if r["block_bytes"] == smallest),
                   key=lambda r: r["request_bytes"])
        summary["coalesce_point"] = f"{fmt_bytes(best['block_bytes'])} x {best['blocks']}"
        summary["coalesced_vs_uncoalesced_write"] = best["coalesce_gain_write"]
        summary["coalesced_vs_uncoalesced_read"] = best["coalesce_gain_read"]
        summary["coalesced_vs_uncoalesced_raw_nixl_write"] = best["coalesce_gain_raw_write"]
    dflt = [r for r in rows if "raw_kvpushcfg_vs_default_write" in r]
    if dflt:
        summary["raw_nixl_kvpush_config_vs_default_write"] = geomean(
            [r["raw_kvpushcfg_vs_default_write"] for r in dflt])
        summary["raw_nixl_kvpush_config_vs_default_read"] = geomean(
            [r["raw_kvpushcfg_vs_default_read"] for r in dflt])
    return {"buffer_bytes_per_side": total, "rows": rows, "summary": summary}
