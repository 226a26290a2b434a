"""The "idle means idle" figures: what kvpush costs in CPU, and what its progress policy
costs in latency.

* **Idle pair** -- a Producer and a Consumer, each in its own process, connected (heartbeats
  flowing), nothing to transfer: CPU (both processes, all threads, to the nanosecond:
  :func:`benchmarks._procs.cpu_seconds`) over a window, as % of one core, and how often
  their loop threads woke. Beside it the floor of any liveness check: the same two
  processes exchanging a ping and its answer over ZeroMQ every ``heartbeat_s`` and doing
  nothing else (:func:`benchmarks.control_frames.round_trips`). What a wake-up costs
  depends on the host: where a thread's memory goes cold while it sleeps, its first work
  after a long sleep costs several times its hot CPU (``host_cold_work_x`` measures it),
  and both kvpush and the floor pay that. Then the same for a pair of raw NIXL agents with NIXL's
  default configuration (progress thread on, polling without pause) that know each other,
  and (full mode) a raw pair configured the way kvpush configures NIXL.
* **CPU-seconds per GiB** -- both processes, while requests of 4 MiB (64 scattered 64 KiB
  blocks) move at a moderate fixed rate: kvpush push (the consumer registers each request,
  the producer calls ``prefill_done`` 2 ms later) vs raw NIXL with the default config (the
  initiator posts a WRITE with a notification at the same instants and checks completion
  every 200 us; the target collects notifications every 1 ms) and vs raw NIXL in kvpush's
  configuration (same loop). Both processes follow one schedule on the shared monotonic
  clock, so each side's own pacing costs the same in every variant.
* **Handover latency per policy** -- one request at a time (registration already at the
  producer), ``prefill_done`` -> the consumer reports READY, with both endpoints under
  ``ProgressPolicy()`` (default), ``latency_first()`` and ``cpu_first()``, interleaved.
  On this 2-core host the handover is bimodal under default and latency_first alike
  (one-block pushes: up to a third of them 200-300 us slower; ``benchmarks.hot_path``'s
  stages show such a request slower from its first stage on, the engine's call and the
  loop's wake-up included: the host's, not one part of kvpush's), so the p50s are taken
  over 61 requests (quick) or 121: over 15, a median fell in the upper mode now and then,
  and the default's ratio read 1.2-1.4 with nothing changed.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import threading
import time
from typing import Any

import numpy as np

from ._common import KIB, Progress, RawAgent, block_ids, descriptor_table, pct, sorted_pairs
from ._procs import Worker, stop_all
from .control_frames import round_trips

__all__ = ["run"]

NAME = "cpu"
DESCRIPTION = ("CPU: an idle pair, CPU-seconds per GiB moved against raw NIXL, and the latency "
               "of each ProgressPolicy")
SUMMARY_KEYS: dict[str, str] = {
    "idle_cpu_pct_pair": "a connected, idle Producer + Consumer pair, % of one core",
    "idle_wakeups_per_s_pair": "the idle pair's loop-thread wake-ups per second, both",
    "idle_cpu_pct_pair_floor": "two processes exchanging a ping and its answer every "
                               "heartbeat_s over ZeroMQ, nothing else, % of one core",
    "idle_cpu_pct_pair_over_floor": "the idle pair's CPU over that floor's",
    "host_cold_work_x": "this host: a thread's CPU for a small Python job after 0.5 s asleep, "
                        "over the same job's back-to-back",
    "idle_cpu_pct_pair_raw_nixl_default":
        "an idle raw NIXL pair in NIXL's default configuration, % of one core",
    "cpu_seconds_per_gib":
        "kvpush push of 4 MiB requests at 40/s, CPU-seconds per GiB, both processes",
    "cpu_seconds_per_gib_raw_nixl_default": "the same stream over raw NIXL, default configuration",
    "cpu_seconds_per_gib_vs_raw_nixl_default": "kvpush's over raw NIXL default's",
    "cpu_seconds_per_gib_raw_nixl_kvpush_config":
        "the same stream over raw NIXL in kvpush's configuration: the floor",
    "handover_latency_{policy}_over_latency_first":
        "handover p50 under that ProgressPolicy over latency_first's (_large: 64 x 64 KiB)",
    "handover_latency_default_over_latency_first_large": "the same for 64 x 64 KiB requests",
    "handover_latency_{policy}_small_us_p50": "one-block handover p50 under that policy, us",
}

_M = "benchmarks.cpu:"
STREAM_BLOCK = 64 * KIB
STREAM_BLOCKS = 64          # 4 MiB per request
STREAM_BUFFER = 64 << 20    # per side
POLICIES = ("default", "latency_first", "cpu_first")


def _policy(name: str) -> Any:
    import kvpush

    if name == "default":
        return kvpush.ProgressPolicy()
    return getattr(kvpush.ProgressPolicy, name)()


# =========================================================================================
# Side functions
# =========================================================================================
def side_buffer(state: dict[str, Any], conn: mpc.Connection, nbytes: int) -> int:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(1)
    state["buf"] = buf
    return int(buf.ctypes.data)


def side_producer(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                  policy: str = "default", tag: str = "main") -> str:
    import kvpush

    from ._common import single_region_layout

    layout = single_region_layout(state["buf"], block_bytes)
    done: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def event(rid: str) -> threading.Event:
        with lock:
            return done.setdefault(rid, threading.Event())

    producer = kvpush.Producer(layout, kvpush.ProducerConfig(progress=_policy(policy)),
                               on_release=lambda r: event(r.request_id).set())
    state.setdefault("producers", {})[tag] = (producer, event)
    state["cleanup"].append(producer.close)
    address: str = producer.address
    return address


def side_consumer(state: dict[str, Any], conn: mpc.Connection, block_bytes: int,
                  address: str, policy: str = "default", tag: str = "main") -> str:
    import kvpush

    from ._common import single_region_layout

    layout = single_region_layout(state["buf"], block_bytes)
    ready: dict[str, float] = {}
    consumer = kvpush.Consumer(layout, kvpush.ConsumerConfig(progress=_policy(policy)),
                               on_finished=lambda r: ready.__setitem__(r.request_id,
                                                                       time.monotonic()))
    state["cleanup"].append(consumer.close)
    name = consumer.connect(address, timeout=30)
    state.setdefault("consumers", {})[tag] = (consumer, name, ready)
    return name


def side_wakeups(state: dict[str, Any], conn: mpc.Connection) -> int:
    """How often this process's endpoints' loop threads have come back from a wait."""
    return sum(int(entry[0].stats()["loop_wakeups"])
               for key in ("producers", "consumers") for entry in state.get(key, {}).values())


def _cold_job() -> int:
    """A small Python job that allocates: 2,000 dictionary inserts (~0.3 ms hot here)."""
    d = {str(i): i for i in range(2000)}
    return len(d)


def side_cold_work(state: dict[str, Any], conn: mpc.Connection, sleeps: int,
                   sleep_s: float) -> float:
    """The host's cost of a wake-up: this thread's CPU for :func:`_cold_job` after each of
    ``sleeps`` sleeps of ``sleep_s``, over its CPU for the same job back-to-back."""
    def cpu_ns(before_each: float, times: int) -> int:
        total = 0
        for _ in range(times):
            if before_each:
                time.sleep(before_each)
            t0 = time.thread_time_ns()
            _cold_job()
            total += time.thread_time_ns() - t0
        return total

    cpu_ns(0.0, 20)   # warm
    hot = cpu_ns(0.0, 20) / 20
    return cpu_ns(sleep_s, sleeps) / sleeps / hot


def side_close_endpoints(state: dict[str, Any], conn: mpc.Connection) -> None:
    for key in ("consumers", "producers"):
        for entry in state.pop(key, {}).values():
            entry[0].close()
            state["cleanup"].remove(entry[0].close)


def side_raw(state: dict[str, Any], conn: mpc.Connection, config: str, tag: str) -> bytes:
    agent = RawAgent(f"cpu-{config}-{tag}", config)
    agent.register([state["buf"]])
    state["raw"] = agent
    return agent.metadata()


def side_raw_peer(state: dict[str, Any], conn: mpc.Connection, metadata: bytes,
                  peer_addr: int) -> None:
    agent: RawAgent = state["raw"]
    peer = agent.add_peer(metadata)
    nb = state["buf"].nbytes // STREAM_BLOCK
    state["raw_dl"] = (
        agent.prep("NIXL_INIT_AGENT", descriptor_table([state["buf"].ctypes.data], nb,
                                                       STREAM_BLOCK)),
        agent.prep(peer, descriptor_table([peer_addr], nb, STREAM_BLOCK)))
    state["raw_peer"] = peer


def side_raw_warm(state: dict[str, Any], conn: mpc.Connection) -> None:
    """One small WRITE, so the connection exists before anything is measured."""
    agent: RawAgent = state["raw"]
    local, remote = state["raw_dl"]
    idx = np.array([0], dtype=np.int32)
    agent.xfer("WRITE", local, idx, remote, idx, poll_sleep=1e-4)


def side_raw_close(state: dict[str, Any], conn: mpc.Connection) -> None:
    agent = state.pop("raw", None)
    state.pop("raw_dl", None)
    if agent is not None:
        agent.close()


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def side_stream_consumer(state: dict[str, Any], conn: mpc.Connection, t0: float, n: int,
                         period: float, dst: np.ndarray) -> int:
    consumer, name, _ = state["consumers"]["main"]
    handles = []
    for i in range(n):
        _sleep_until(t0 + i * period)
        handles.append(consumer.expect(f"s{t0:.3f}-{i}", dst, name, timeout=60))
    ok = 0
    for h in handles:
        ok += h.wait(60).ok
    return ok


def side_stream_producer(state: dict[str, Any], conn: mpc.Connection, t0: float, n: int,
                         period: float, src: np.ndarray, lag: float) -> int:
    producer, event = state["producers"]["main"]
    rids = [f"s{t0:.3f}-{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        _sleep_until(t0 + i * period + lag)
        producer.prefill_done(rid, src)
    return sum(event(rid).wait(60) for rid in rids)


def side_stream_raw_initiator(state: dict[str, Any], conn: mpc.Connection, t0: float, n: int,
                              period: float, src: np.ndarray, dst: np.ndarray,
                              lag: float) -> int:
    agent: RawAgent = state["raw"]
    local, remote = state["raw_dl"]
    li, ri = (a.astype(np.int32) for a in sorted_pairs(src, dst))
    for i in range(n):
        _sleep_until(t0 + i * period + lag)
        agent.xfer("WRITE", local, li, remote, ri, notif=f"done-{i}".encode(), poll_sleep=2e-4)
    return n


def side_stream_raw_target(state: dict[str, Any], conn: mpc.Connection, n: int,
                           timeout: float) -> int:
    agent: RawAgent = state["raw"]
    got = 0
    deadline = time.monotonic() + timeout
    while got < n and time.monotonic() < deadline:
        for notes in agent.agent.get_new_notifs().values():
            got += len(notes)
        time.sleep(1e-3)
    return got


def side_expect_one(state: dict[str, Any], conn: mpc.Connection, tag: str, rid: str,
                    dst: np.ndarray) -> None:
    consumer, name, _ = state["consumers"][tag]
    state["pending"] = consumer.expect(rid, dst, name, timeout=30)


def side_wait_one(state: dict[str, Any], conn: mpc.Connection, tag: str, rid: str) -> float:
    result = state.pop("pending").wait(30)
    if not result.ok:
        raise RuntimeError(f"{rid}: {result.state} {result.error}")
    ready_at = state["consumers"][tag][2]
    deadline = time.monotonic() + 5.0
    while rid not in ready_at:  # the callback runs just after the handle is set
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid}: no on_finished callback")
        time.sleep(1e-4)
    ready: float = ready_at.pop(rid)
    return ready


def side_push_one(state: dict[str, Any], conn: mpc.Connection, tag: str, rid: str,
                  src: np.ndarray) -> float:
    from .throughput import _wait_registrations

    producer, event = state["producers"][tag]
    _wait_registrations(1, 10.0)
    time.sleep(0.002)  # let both loops go back to sleep: measure from idle
    t_done = time.monotonic()
    producer.prefill_done(rid, src)
    if not event(rid).wait(30):
        raise TimeoutError(f"{rid} not released")
    return t_done


# =========================================================================================
# Orchestration
# =========================================================================================
def kvpush_heartbeat_s() -> float:
    """How often an idle Consumer checks that its producer is alive (its default)."""
    import kvpush

    return float(kvpush.ConsumerConfig().heartbeat_s)


def _cpu_window(workers: list[Worker], seconds: float) -> float:
    """% of one core used by ``workers`` together over ``seconds``."""
    before = [w.cpu_seconds() for w in workers]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    after = [w.cpu_seconds() for w in workers]
    return 100.0 * sum(b - a for a, b in zip(before, after, strict=True)) / elapsed


def _raw_pair(a: Worker, b: Worker, config: str, addrs: tuple[int, int]) -> None:
    md_a = a.call(_M + "side_raw", config=config, tag="a")
    md_b = b.call(_M + "side_raw", config=config, tag="b")
    a.call(_M + "side_raw_peer", metadata=md_b, peer_addr=addrs[1])
    b.call(_M + "side_raw_peer", metadata=md_a, peer_addr=addrs[0])
    a.call(_M + "side_raw_warm")


def _raw_close(a: Worker, b: Worker) -> None:
    a.call(_M + "side_raw_close")
    b.call(_M + "side_raw_close")


def run(quick: bool, progress: bool = True, idle_s: float | None = None,
        raw_idle_s: float | None = None, stream_s: float | None = None,
        rate: float = 40.0, latency_reps: int | None = None,
        policies: tuple[str, ...] = POLICIES, raw_floor: bool = True) -> dict[str, Any]:
    """All figures of the module docstring; ``policies`` must start with "default" and
    "latency_first"; ``raw_floor=False`` skips the stream over raw NIXL in kvpush's
    configuration."""
    idle_s = idle_s if idle_s is not None else 10.0
    raw_idle_s = raw_idle_s if raw_idle_s is not None else (3.0 if quick else 10.0)
    stream_s = stream_s if stream_s is not None else (3.0 if quick else 10.0)
    latency_reps = latency_reps or (61 if quick else 121)
    bar = Progress("cpu", 9 + (0 if quick else 1), progress)
    a, b = Worker("cpu-A"), Worker("cpu-B")
    out: dict[str, Any] = {"rate_rps": rate, "request_bytes": STREAM_BLOCK * STREAM_BLOCKS}
    try:
        addrs = (a.call(_M + "side_buffer", nbytes=STREAM_BUFFER),
                 b.call(_M + "side_buffer", nbytes=STREAM_BUFFER))
        bar.step("workers up")
        # -- idle pair -------------------------------------------------------------------
        address = a.call(_M + "side_producer", block_bytes=STREAM_BLOCK)
        b.call(_M + "side_consumer", block_bytes=STREAM_BLOCK, address=address)
        time.sleep(1.0)  # let the handshake's traffic settle
        bar.show(f"idle kvpush pair ({idle_s:.0f} s)")
        woke = [w.call(_M + "side_wakeups") for w in (a, b)]
        out["idle_cpu_pct_pair"] = _cpu_window([a, b], idle_s)
        out["idle_window_s"] = idle_s
        out["idle_wakeups_per_s_pair"] = sum(
            w.call(_M + "side_wakeups") - n for w, n in zip((a, b), woke, strict=True)) / idle_s
        bar.step(f"idle kvpush pair: {out['idle_cpu_pct_pair']:.2f} %, "
                 f"{out['idle_wakeups_per_s_pair']:.1f} wake-ups/s")
        # -- CPU per GiB: kvpush ----------------------------------------------------------
        nb = STREAM_BUFFER // STREAM_BLOCK
        src, dst = block_ids("scattered", STREAM_BLOCKS, nb, nb, seed=5)
        n = max(10, int(stream_s * rate))
        gib = n * STREAM_BLOCK * STREAM_BLOCKS / (1 << 30)
        out["stream_requests"] = n
        out["stream_gib"] = gib
        period = 1.0 / rate

        def stream(kind: str) -> float:
            t0 = time.monotonic() + 0.3
            before = [w.cpu_seconds() for w in (a, b)]
            if kind == "kvpush":
                b.send_call(_M + "side_stream_consumer", t0=t0, n=n, period=period, dst=dst)
                a.send_call(_M + "side_stream_producer", t0=t0, n=n, period=period, src=src,
                            lag=0.002)
            else:
                b.send_call(_M + "side_stream_raw_target", n=n, timeout=n * period + 30)
                a.send_call(_M + "side_stream_raw_initiator", t0=t0, n=n, period=period,
                            src=src, dst=dst, lag=0.002)
            got_a = a.result(n * period + 60)
            got_b = b.result(n * period + 60)
            if got_a != n or got_b != n:
                raise RuntimeError(f"{kind} stream: {got_a}/{got_b} of {n} requests")
            after = [w.cpu_seconds() for w in (a, b)]
            return sum(y - x for x, y in zip(before, after, strict=True))

        cpu_kv = stream("kvpush")
        out["cpu_seconds_kvpush"] = cpu_kv
        out["cpu_seconds_per_gib"] = cpu_kv / gib
        bar.step(f"kvpush stream: {cpu_kv / gib:.3f} CPU-s/GiB")
        a.call(_M + "side_close_endpoints")
        b.call(_M + "side_close_endpoints")
        # -- the idle floor: a ping and its answer every heartbeat_s, nothing else ----------
        heartbeat_s = min(kvpush_heartbeat_s(), idle_s)
        pings = max(1, round(idle_s / heartbeat_s))
        bar.show(f"idle floor: {pings} pings {heartbeat_s:g} s apart")
        per_frame = round_trips(b, a, "zmq_tcp", frames=pings, size=64, gap_s=heartbeat_s)
        out["idle_cpu_pct_pair_floor"] = 100.0 * 2 * per_frame["total_us"] / 1e6 / heartbeat_s
        out["idle_cpu_pct_pair_over_floor"] = (out["idle_cpu_pct_pair"]
                                               / out["idle_cpu_pct_pair_floor"])
        out["host_cold_work_x"] = a.call(_M + "side_cold_work", sleeps=4, sleep_s=0.5)
        bar.step(f"idle floor: {out['idle_cpu_pct_pair_floor']:.2f} %, a job after 0.5 s "
                 f"asleep: {out['host_cold_work_x']:.1f}x its hot CPU")
        # -- handover latency per policy -----------------------------------------------------
        for pol in policies:
            address = a.call(_M + "side_producer", block_bytes=STREAM_BLOCK, policy=pol,
                             tag=pol)
            b.call(_M + "side_consumer", block_bytes=STREAM_BLOCK, address=address,
                   policy=pol, tag=pol)
        lat: dict[str, dict[str, list[float]]] = {p: {"small": [], "large": []}
                                                  for p in policies}
        sizes = {"small": block_ids("scattered", 1, nb, nb, seed=9),
                 "large": (src, dst)}
        for i in range(latency_reps):
            for size, (s_ids, d_ids) in sizes.items():
                for pol in policies:
                    rid = f"lat-{pol}-{size}-{i}"
                    b.call(_M + "side_expect_one", tag=pol, rid=rid, dst=d_ids)
                    t_done = a.call(_M + "side_push_one", tag=pol, rid=rid, src=s_ids)
                    t_ready = b.call(_M + "side_wait_one", tag=pol, rid=rid)
                    lat[pol][size].append(t_ready - t_done)
            bar.show(f"handover latency {i + 1}/{latency_reps}")
        for pol in policies:
            for size in sizes:
                out[f"handover_latency_{pol}_{size}_us_p50"] = pct(lat[pol][size], 50) * 1e6
                out[f"handover_latency_{pol}_{size}_us_p90"] = pct(lat[pol][size], 90) * 1e6
        d, lf = (out[f"handover_latency_{p}_small_us_p50"] for p in ("default", "latency_first"))
        out["handover_latency_default_over_latency_first"] = d / lf
        if "cpu_first" in policies:
            out["handover_latency_cpu_first_over_latency_first"] = (
                out["handover_latency_cpu_first_small_us_p50"] / lf)
        out["handover_latency_default_over_latency_first_large"] = (
            out["handover_latency_default_large_us_p50"]
            / out["handover_latency_latency_first_large_us_p50"])
        bar.step(f"handover latency default/latency-first {d / lf:.2f}")
        a.call(_M + "side_close_endpoints")
        b.call(_M + "side_close_endpoints")
        # -- raw NIXL, default config: idle, then the same stream ----------------------------
        _raw_pair(a, b, "default", addrs)
        time.sleep(0.5)
        bar.show(f"idle raw NIXL default pair ({raw_idle_s:.0f} s)")
        out["idle_cpu_pct_pair_raw_nixl_default"] = _cpu_window([a, b], raw_idle_s)
        bar.step(f"idle raw default pair: {out['idle_cpu_pct_pair_raw_nixl_default']:.0f} %")
        cpu_raw = stream("raw")
        out["cpu_seconds_raw_nixl_default"] = cpu_raw
        out["cpu_seconds_per_gib_raw_nixl_default"] = cpu_raw / gib
        out["cpu_seconds_per_gib_vs_raw_nixl_default"] = cpu_kv / cpu_raw
        bar.step(f"raw default stream: {cpu_raw / gib:.3f} CPU-s/GiB")
        _raw_close(a, b)
        # -- raw NIXL, kvpush's configuration ---------------------------------------------
        if raw_floor:
            _raw_pair(a, b, "kvpush", addrs)
            if not quick:
                out["idle_cpu_pct_pair_raw_nixl_kvpush_config"] = _cpu_window([a, b],
                                                                              raw_idle_s)
                bar.step("idle raw kvpush-config pair")
            cpu_rawk = stream("raw")
            out["cpu_seconds_per_gib_raw_nixl_kvpush_config"] = cpu_rawk / gib
            bar.step(f"raw kvpush-config stream: {cpu_rawk / gib:.3f} CPU-s/GiB")
            _raw_close(a, b)
        bar.step("done")
    finally:
        stop_all([b, a])
        bar.finish()
    summary_keys = [
        "idle_cpu_pct_pair", "idle_wakeups_per_s_pair", "idle_cpu_pct_pair_floor",
        "idle_cpu_pct_pair_over_floor", "host_cold_work_x", "idle_cpu_pct_pair_raw_nixl_default",
        "cpu_seconds_per_gib", "cpu_seconds_per_gib_raw_nixl_default",
        "cpu_seconds_per_gib_vs_raw_nixl_default", "cpu_seconds_per_gib_raw_nixl_kvpush_config",
        "handover_latency_default_over_latency_first",
        "handover_latency_cpu_first_over_latency_first",
        "handover_latency_default_over_latency_first_large",
        "handover_latency_default_small_us_p50", "handover_latency_latency_first_small_us_p50",
        "handover_latency_cpu_first_small_us_p50",
    ]
    out["summary"] = {k: out[k] for k in summary_keys if k in out}
    return out
