"""CPU time per request: kvpush against raw NIXL on the same descriptors, counted in CPU
time of every thread of both processes, so a busy or shared host's scheduling does not
change the figure the way it changes wall-clock ones.

Two spawned engine processes, each holding the critical path's cache (16 regions of 4 KiB
blocks: 8 layers, K and V apart) with a kvpush endpoint (a prefill Producer, a decode
Consumer) and a raw NIXL agent configured as kvpush configures its own (progress thread off,
``ucx_error_handling_mode=none``). Requests of 1, 16 and 256 blocks (64 KiB, 1 MiB, 16 MiB;
16 to 4,096 descriptors) run on a fixed schedule on the shared monotonic clock, one every
``period`` (longer than one request takes), so each starts from idle as an engine's does.
Per size, six variants take turns in rounds, so a slow phase of the host hits them alike:

* ``push`` -- the decode engine's thread calls ``expect`` at the request's instant, the
  prefill engine's thread ``prefill_done`` 1 ms later; completions reach both engines
  through the endpoints' callbacks (no engine thread wakes for them);
* ``pull`` -- the prefill engine makes the tickets (``prefill_done(PULL)``) when the batch
  starts, the decode engine's thread calls ``pull`` at each instant;
* ``raw_write`` / ``raw_read`` -- one thread of the initiator (prefill for a WRITE, decode
  for a READ) posts (``make_prepped_xfer`` + ``transfer``) and polls ``check_xfer_state``
  back-to-back to DONE, then releases the handle; the other process does nothing;
* ``raw_write_notif`` / ``raw_read_notif`` -- the same with a NIXL notification, and the
  other process polling ``get_new_notifs`` back-to-back from the post's instant until the
  notification arrives (what a target that knows a transfer is coming pays to learn it
  landed, as kvpush's consumer learns of a push's post from its ``Posted`` hint);
* ``push_c`` / ``pull_c`` -- ``push`` and ``pull`` between a second pair of endpoints in the
  same processes whose agents reach NIXL through its C API (``TransportConfig(nixl_api=
  "c")``, every NIXL call without the GIL) instead of its Python binding;
* ``floor_push`` / ``floor_pull`` -- the shape of an engine integration with no kvpush in
  it (:class:`_FloorLoop`): in each process a loop thread asleep in a ``zmq.Poller`` on a
  ZeroMQ socket and an eventfd, handed each engine call through a queue and the eventfd,
  as kvpush's is. Push: the decode loop sends a 64-byte registration; the prefill loop,
  handed ``prefill_done``, posts the raw WRITE with a notification, polls it to its end,
  sends a 64-byte hint and marks the request released; the decode loop, woken by the hint,
  reads the notification (it is there: the hint left after the WRITE's end) and marks the
  result. Pull: the decode loop, handed ``pull``, posts the raw READ, polls it to its end,
  marks the result and sends a 64-byte frame; the prefill loop, woken by it, marks the
  release. The same thread wake-ups, control frames and NIXL work as kvpush's request
  with none of kvpush's own work (no protocol, encoding, timers or progress policy): what
  any design of this shape pays on this host, and so what kvpush can be held to.

Each pair's loop thread counts as ``loop`` in its own variants and not at all in the
others' (it idles there: ``cpu_us_per_idle_s`` says what that costs).

CPU is each thread's ``sum_exec_runtime`` (nanoseconds, Linux's ``/proc/PID/task/TID/
schedstat``), read by the parent before and after each batch, all threads of both
processes, and split by thread kind: the engine's thread (the worker's main thread, which
makes the calls), kvpush's loop thread, ZeroMQ's I/O threads (``ZMQbg/*``), and the rest
(UCX's and NIXL's own threads, Python's; none of them polls in kvpush's configuration). A
batch's window includes its idle edges (a few hundred ms); ``cpu_us_per_idle_s`` says what
they add (near zero).

The GIL: the time kvpush holds it per request is taken as the CPU time of the two threads
that run kvpush's Python -- the loop thread (all of its CPU) and the engine's thread inside
kvpush's calls (``time.thread_time`` around each call) -- both processes -- less, for the
pair on NIXL's C API, what those threads spent inside NIXL without the GIL (``kvpush.
_nixlc`` counts it: ``released_us``, a post's copy mostly). Error: it still counts CPU those
threads spend with the GIL released elsewhere (the blocking poll's ``epoll_wait`` and the
loop's sleeps: a few us per wake-up; over the binding, whatever of NIXL's calls it runs
without the GIL, which cannot be told apart), so it over-counts by that; it misses time a
thread holds the GIL while preempted, bounded by those threads' run-queue wait, reported
beside it (``gil_rq_us``).

``python -m benchmarks.cpu_per_request [--quick] [--policy default|latency_first|cpu_first]
[--json PATH]``
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.connection as mpc
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._common import Progress, RawAgent, open_endpoint, save_json
from ._procs import Worker, stop_all, thread_schedstats
from .critical_path import _make_cache
from .hot_path import SHAPES

__all__ = ["run", "table"]

log = logging.getLogger("benchmarks")

NAME = "cpu_per_request"
DESCRIPTION = ("CPU time per request of kvpush push and pull against raw NIXL on the same "
               "descriptors, all threads of both processes, by thread kind; the GIL held per "
               "request; CPU per idle second")
SUMMARY_KEYS: dict[str, str] = {
    "cpu_us_per_request_{mode}_{size}":
        "kvpush push or pull, CPU us per request, all threads of both processes (size: "
        "64kib, 1mib, 16mib)",
    "raw_nixl_cpu_us_per_request_{size}":
        "raw NIXL WRITE of the same descriptors, one thread posting and polling, CPU us per "
        "request",
    "raw_nixl_read_cpu_us_per_request_{size}": "the same for a raw READ",
    "raw_nixl_notif_cpu_us_per_request_{size}":
        "raw WRITE with a notification, the target polling for it from the post, CPU us",
    "raw_nixl_read_notif_cpu_us_per_request_{size}": "the same for a raw READ",
    "cpu_per_request_{mode}_over_raw_nixl_{size}":
        "kvpush's CPU per request over raw NIXL's without a notification (push: WRITE, "
        "pull: READ; the notified variants poll back-to-back, a dearer floor)",
    "gil_us_per_request_{mode}":
        "CPU of the threads running kvpush's Python per request (loop thread + the engine's "
        "thread inside kvpush calls, both processes), less, over NIXL's C API (push_c, "
        "pull_c), their CPU inside NIXL without the GIL: the GIL held, us (bare: 1 MiB; "
        "_{size}: that size)",
    "floor_cpu_us_per_request_{mode}_{size}":
        "the shape of an engine integration with no kvpush in it (floor_push, floor_pull: "
        "the same thread hand-offs, control frames and NIXL work), CPU us per request",
    "cpu_per_request_{mode}_over_floor_{size}":
        "kvpush's CPU per request over that floor's, same run: kvpush's own work",
    "floor_over_raw_nixl_{mode}_{size}":
        "the floor's CPU per request over raw NIXL's without a notification: above 2, no "
        "design of this shape meets a 2x-raw target here",
    "cpu_us_per_idle_s": "both processes, endpoints connected and idle, CPU us per second",
    "nixl_c_over_binding_cpu_{mode}_{size}":
        "kvpush's CPU per request with its agents on NIXL's C API over the same with NIXL's "
        "Python binding, same run (mode: push, pull)",
}

_M = "benchmarks.cpu_per_request:"
SHAPE = SHAPES["layers"]
SIZES = {"64kib": 1, "1mib": 16, "16mib": 256}            # blocks per request
VARIANTS = ("push", "pull", "raw_write", "raw_read", "raw_write_notif", "raw_read_notif",
            "push_c", "pull_c", "floor_push", "floor_pull")
#: The NIXL interface each endpoint pair's agents use (``TransportConfig.nixl_api``).
APIS = ("python", "c")
#: The loop thread that counts as "loop" in the floor variants.
FLOOR = "floor"
KINDS = ("engine", "loop", "zmq", "other")   # "idle": the other pair's loop, not counted
#: The endpoints' progress policies: the default and :class:`kvpush.ProgressPolicy`'s presets.
POLICIES = ("default", "latency_first", "cpu_first")
LAG_S = 1e-3     # prefill_done after expect: the registration is there first
WAIT_S = 60.0


# =========================================================================================
# Side functions (run in the workers)
# =========================================================================================
def side_setup(state: dict[str, Any], conn: mpc.Connection, role: str,
               address: dict[str, str] | None = None, policy: str = "default") -> dict[str, Any]:
    import kvpush

    progress = _policy(policy)

    buffers, layout = _make_cache(SHAPE.num_blocks)
    state.update(buffers=buffers, layout=layout, shape=SHAPE, role=role)
    raw = RawAgent(f"cpr-raw-{role}", "kvpush")
    raw.register(buffers)
    state["raw"] = raw
    state["cleanup"].append(raw.close)
    done: dict[str, threading.Event] = {}

    def event(rid: str) -> threading.Event:
        return done.setdefault(rid, threading.Event())

    state["event"] = event
    out: dict[str, Any] = {"raw_md": raw.metadata(),
                           "bases": [int(b.ctypes.data) for b in buffers],
                           "engine_tid": threading.get_native_id(), "loop_tids": {},
                           "address": {}, "progress": repr(progress)}
    state["pairs"] = {}
    for api in APIS:
        pair: dict[str, Any] = {"cleanup": state["cleanup"]}
        transport = kvpush.TransportConfig(nixl_api=api)
        if role == "prefill":
            out["address"][api] = open_endpoint(
                pair, role, layout,
                config=kvpush.ProducerConfig(lease_s=120.0, transport=transport,
                                             progress=progress),
                on_release=lambda r: event(r.request_id).set())
        else:
            open_endpoint(pair, role, layout, (address or {})[api],
                          config=kvpush.ConsumerConfig(transport=transport, progress=progress),
                          on_finished=lambda r: event(r.request_id).set())
        state["pairs"][api] = pair
        out["loop_tids"][api] = pair["endpoint"]._driver.thread.native_id
    state.update(state["pairs"]["python"])
    floor = _FloorLoop(state, role, (address or {}).get(FLOOR, ""))
    state["floor"] = floor
    state["cleanup"].append(floor.close)
    out["address"][FLOOR] = floor.address
    out["loop_tids"][FLOOR] = floor.tid
    from kvpush import _nixlc  # the "c" pair's agents loaded it
    _nixlc.count_released(True)
    return out


def _policy(name: str) -> Any:
    """The endpoints' :class:`kvpush.ProgressPolicy` by name: ``default`` or a preset's."""
    import kvpush

    if name not in POLICIES:
        raise ValueError(f"unknown progress policy {name!r}; choose from {POLICIES}")
    return kvpush.ProgressPolicy() if name == "default" else getattr(kvpush.ProgressPolicy, name)()


def side_released_ns(state: dict[str, Any], conn: mpc.Connection) -> int:
    """CPU ns this process's threads have spent inside NIXL's C API without the GIL."""
    from kvpush import _nixlc

    return int(_nixlc.released_cpu_ns())


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _wait_all(state: dict[str, Any], rids: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    for rid in rids:
        if not state["event"](rid).wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{rid}: not finished in {WAIT_S} s")


def _engine_calls(state: dict[str, Any], items: list[Any], t0: float, period: float,
                  call: Callable[[Any], object], rids: list[str]) -> float:
    """The engine's thread: ``call(item)`` for each item at its instant (``t0 + i *
    period``), then wait for every request of ``rids``; returns the CPU seconds this thread
    spent inside the calls."""
    inside = 0.0
    for i, item in enumerate(items):
        _sleep_until(t0 + i * period)
        c0 = time.thread_time()
        call(item)
        inside += time.thread_time() - c0
    _wait_all(state, rids)
    return inside


def side_expect(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
                ids: np.ndarray, t0: float, period: float, api: str = "python") -> float:
    """Push, decode side: ``expect`` each request at its instant; waits for all; returns
    the CPU seconds this thread spent inside the calls."""
    if api == FLOOR:
        floor: _FloorLoop = state["floor"]
        return _engine_calls(state, rids, t0, period, floor.expect, rids)
    pair = state["pairs"][api]
    return _engine_calls(state, rids, t0, period, lambda rid: pair["endpoint"].expect(
        rid, ids, pair["producer"], timeout=WAIT_S), rids)


def side_prefill_done(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
                      ids: np.ndarray, t0: float, period: float, api: str = "python",
                      local: np.ndarray | None = None, remote: np.ndarray | None = None
                      ) -> float:
    """Push, prefill side: ``prefill_done`` each request ``LAG_S`` after its instant (the
    floor: the raw WRITE of descriptor indices ``local`` -> ``remote``)."""
    if api == FLOOR:
        if local is None or remote is None:
            raise ValueError("the floor's prefill_done needs the WRITE's descriptor indices")
        floor: _FloorLoop = state["floor"]
        src, dst = local, remote
        return _engine_calls(state, rids, t0 + LAG_S, period,
                             lambda rid: floor.prefill_done(rid, src, dst), rids)
    producer = state["pairs"][api]["endpoint"]
    return _engine_calls(state, rids, t0 + LAG_S, period,
                         lambda rid: producer.prefill_done(rid, ids), rids)


def side_tickets(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
                 ids: np.ndarray, api: str = "python") -> tuple[list[bytes], float]:
    """Pull, prefill side: every request's ticket at once; (tickets, CPU s in the calls)."""
    import kvpush

    producer = state["pairs"][api]["endpoint"]
    c0 = time.thread_time()
    tickets = [producer.prefill_done(rid, ids, kvpush.TransferMode.PULL).to_bytes()
               for rid in rids]
    return tickets, time.thread_time() - c0


def side_wait(state: dict[str, Any], conn: mpc.Connection, rids: list[str]) -> float:
    _wait_all(state, rids)
    return 0.0


def side_pull(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
              tickets: list[bytes], ids: np.ndarray, t0: float, period: float,
              api: str = "python") -> float:
    """Pull, decode side: ``pull`` each ticket at its instant; waits for all."""
    consumer = state["pairs"][api]["endpoint"]
    return _engine_calls(state, tickets, t0, period,
                         lambda ticket: consumer.pull(ticket, ids, timeout=WAIT_S), rids)


def side_floor_pull(state: dict[str, Any], conn: mpc.Connection, rids: list[str],
                    local: np.ndarray, remote: np.ndarray, t0: float, period: float) -> float:
    """Pull, decode side of the floor: hand each READ to the floor's loop at its instant."""
    floor: _FloorLoop = state["floor"]
    return _engine_calls(state, rids, t0, period,
                         lambda rid: floor.pull(rid, local, remote), rids)


def side_raw_post(state: dict[str, Any], conn: mpc.Connection, op: str, local: np.ndarray,
                  remote: np.ndarray, t0: float, period: float, n: int,
                  notif: bool) -> float:
    """Raw NIXL initiator: at each instant post ``op`` (with a notification if ``notif``),
    poll back-to-back to DONE, release the handle."""
    raw: RawAgent = state["raw"]
    for i in range(n):
        _sleep_until(t0 + i * period)
        raw.xfer(op, state["raw_local"], local, state["raw_remote"], remote,
                 notif=f"cpr-{i}".encode() if notif else b"")
    return 0.0


def side_raw_listen(state: dict[str, Any], conn: mpc.Connection, t0: float, period: float,
                    n: int) -> float:
    """Raw NIXL target: from each post's instant, poll ``get_new_notifs`` back-to-back
    until that transfer's notification is here."""
    agent = state["raw"].agent
    got = 0
    deadline = time.monotonic() + n * period + WAIT_S
    for i in range(n):
        _sleep_until(t0 + i * period)
        while got <= i:
            for notes in agent.get_new_notifs().values():
                got += len(notes)
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw notifications: {got} of {n}")
    return 0.0


class _FloorLoop:
    """The floor variants' loop thread (see the module doc): asleep in a ``zmq.Poller`` on
    one ZeroMQ socket (a ROUTER on the prefill side, a DEALER on the decode side, kvpush's
    socket types) and an eventfd; engine calls reach it through a queue and the eventfd.
    Requests end by setting the worker's per-request event, as the endpoints' callbacks
    do. A request it cannot finish (no notification within ``WAIT_S``) is logged and left
    unset, so the batch's wait times out naming it."""

    DECODE = b"floor-decode"

    def __init__(self, state: dict[str, Any], role: str, address: str = "") -> None:
        import zmq

        self._state = state
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER if role == "prefill" else zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if role == "prefill":
            self._sock.bind("tcp://127.0.0.1:*")
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.setsockopt(zmq.IDENTITY, self.DECODE)
            self._sock.connect(address)
            self.address = address
        self._wake = os.eventfd(0, os.EFD_NONBLOCK)
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake, zmq.POLLIN)
        self._registered: set[str] = set()
        self._waiting: dict[str, Callable[[], None]] = {}   # prefill_done before its Register
        self._notes: set[bytes] = set()                      # notifications read, not yet used
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="floor-loop", daemon=True)
        self._thread.start()

    @property
    def tid(self) -> int:
        return int(self._thread.native_id or 0)

    # -- the engine's calls (its thread) ------------------------------------------------
    def _call(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)
        os.eventfd_write(self._wake, 1)

    def expect(self, rid: str) -> None:
        self._call(lambda: self._send(None, b"R" + rid.encode()))

    def prefill_done(self, rid: str, local: np.ndarray, remote: np.ndarray) -> None:
        self._call(lambda: self._write_when_registered(rid, local, remote))

    def pull(self, rid: str, local: np.ndarray, remote: np.ndarray) -> None:
        def read() -> None:
            self._xfer("READ", local, remote, b"")
            self._state["event"](rid).set()
            self._send(None, b"D" + rid.encode())
        self._call(read)

    # -- the loop thread -----------------------------------------------------------------
    def _send(self, identity: bytes | None, frame: bytes) -> None:
        frame = frame.ljust(64, b"\0")   # the size of a small control frame
        if identity is None:
            self._sock.send(frame)
        else:
            self._sock.send_multipart([identity, frame])

    def _xfer(self, op: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> None:
        raw: RawAgent = self._state["raw"]
        raw.xfer(op, self._state["raw_local"], local, self._state["raw_remote"], remote,
                 notif=notif)

    def _write_when_registered(self, rid: str, local: np.ndarray, remote: np.ndarray) -> None:
        def write() -> None:
            self._registered.discard(rid)
            self._xfer("WRITE", local, remote, rid.encode())
            self._send(self.DECODE, b"H" + rid.encode())
            self._state["event"](rid).set()
        if rid in self._registered:
            write()
        else:
            self._waiting[rid] = write

    def _landed(self, rid: str) -> None:
        note, deadline = rid.encode(), time.monotonic() + WAIT_S
        while note not in self._notes:
            for notes in self._state["raw"].agent.get_new_notifs().values():
                self._notes.update(notes)
            if time.monotonic() > deadline:
                log.error("floor: no notification for %s in %s s", rid, WAIT_S)
                return
        self._notes.discard(note)
        self._state["event"](rid).set()

    def _on_frame(self, frame: bytes) -> None:
        kind, rid = frame[:1], frame[1:].rstrip(b"\0").decode()
        if kind == b"R":
            self._registered.add(rid)
            if rid in self._waiting:
                self._waiting.pop(rid)()
        elif kind == b"H":
            self._landed(rid)
        elif kind == b"D":
            self._state["event"](rid).set()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            events = dict(self._poller.poll())
            if events.get(self._wake):
                os.eventfd_read(self._wake)
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                try:
                    job()
                except Exception:  # its request stays unfinished: the batch names it
                    log.exception("floor: a job failed")
            if events.get(self._sock):
                while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    frame = self._sock.recv_multipart()[-1]
                    try:
                        self._on_frame(frame)
                    except Exception:
                        log.exception("floor: a frame's handling failed")

    def close(self) -> None:
        def stop() -> None:
            self._stop = True
        self._call(stop)
        self._thread.join(5.0)
        if self._thread.is_alive():
            raise RuntimeError("floor loop thread did not stop")
        self._sock.close()
        self._ctx.term()
        os.close(self._wake)


#: kvpush's NIXL wrapper (:class:`kvpush.agent.Agent`): the methods whose CPU the
#: attribution pass counts as NIXL's (the binding or C API, UCX and the copy they run inline).
NIXL_CALLS = ("post", "state", "release", "notifications", "send_notification")
#: What the attribution pass counts on the loop thread, each apart.
PARTS = ("nixl", "core", "send")


def _wrap(obj: Any, name: str, slot: dict[str, int], part: str, tid: int) -> None:
    """Replace ``obj.name`` by a wrapper adding the CPU ns and calls it takes on thread
    ``tid`` to ``slot[part + "_ns" / "_calls"]`` (two clock reads a call, counted outside)."""
    fn = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_native_id() != tid:
            return fn(*args, **kwargs)
        c0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            slot[part + "_ns"] += time.thread_time_ns() - c0
            slot[part + "_calls"] += 1

    setattr(obj, name, timed)


def side_split(state: dict[str, Any], conn: mpc.Connection, on: bool,
               api: str = "python") -> dict[str, int]:
    """Attribution on the loop thread of pair ``api``: ``on`` wraps its agent's NIXL calls,
    its protocol core's public methods and its control frames sent (``send_frame``) in
    ``time.thread_time_ns``; off restores them. Returns, since the last switch, each part's
    CPU ns and calls, and the loop's wake-ups and hot (spinning) iterations."""
    endpoint = state["pairs"][api]["endpoint"]
    tid = endpoint._driver.thread.native_id
    slot = state.setdefault("split", {})
    targets: list[tuple[Any, tuple[str, ...], str]] = [
        (endpoint._agent, NIXL_CALLS, "nixl"), (endpoint._driver, ("send_frame",), "send")]
    core = getattr(endpoint, "_core", None)
    # A core compiled to native code (mypyc) takes no wrappers: its time stays in "loop
    # rest" and its calls read 0.
    if core is not None and "__mypyc_attrs__" not in dir(type(core)):
        targets.append((core, tuple(n for n in dir(type(core)) if not n.startswith("_")
                                    and callable(getattr(core, n))), "core"))
    stats = endpoint.stats()
    if on:
        slot.clear()
        slot.update({f"{p}_{k}": 0 for p in PARTS for k in ("ns", "calls")})
        slot["wakeups0"], slot["hot0"] = stats["loop_wakeups"], stats["hot_polls"]
        for obj, names, part in targets:
            for name in names:
                _wrap(obj, name, slot, part, tid)
        return {}
    for obj, names, _ in targets:
        for name in names:
            obj.__dict__.pop(name, None)
    out = {k: v for k, v in slot.items() if not k.endswith("0")}
    out["wakeups"] = stats["loop_wakeups"] - slot["wakeups0"]
    out["hot_polls"] = stats["hot_polls"] - slot["hot0"]
    return out


# =========================================================================================
# Orchestration
# =========================================================================================
def _threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """Every thread of worker ``pid``: tid -> (command name, ns on a CPU, ns runnable but
    waiting for one)."""
    stats = thread_schedstats(pid)
    if stats is None:
        raise RuntimeError(f"no schedstat for process {pid}: it has gone, or this kernel "
                           "does not keep them")
    return stats


class _Side:
    """One worker and its thread kinds."""

    def __init__(self, worker: Worker, info: dict[str, Any]) -> None:
        self.worker = worker
        self.engine_tid = int(info["engine_tid"])
        self.loop_tids = {api: int(tid) for api, tid in info["loop_tids"].items()}
        self.active = ""   # the pair whose loop thread counts as "loop" now

    def kind(self, tid: int, name: str) -> str:
        if tid == self.engine_tid:
            return "engine"
        if tid in self.loop_tids.values():
            return "loop" if tid == self.loop_tids.get(self.active) else "idle"
        return "zmq" if name.startswith("ZMQbg") else "other"

    def snapshot(self) -> dict[int, tuple[str, int, int]]:
        return _threads(self.worker.pid)

    def delta(self, before: dict[int, tuple[str, int, int]],
              after: dict[int, tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
        """(CPU ns, run-queue ns) by thread kind between two snapshots."""
        out = dict.fromkeys(KINDS, (0, 0))
        for tid, (name, run_ns, wait_ns) in after.items():
            _, run0, wait0 = before.get(tid, (name, 0, 0))
            kind = self.kind(tid, name)
            if kind == "idle":
                continue
            cpu, rq = out[kind]
            out[kind] = (cpu + run_ns - run0, rq + wait_ns - wait0)
        return out


def _raw_indices(op: str, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor indices of the initiator, ordered by local id as kvpush's
    planner posts them (region-major)."""
    local, remote = (src, dst) if op == "WRITE" else (dst, src)
    order = np.argsort(local, kind="stable")
    region = np.arange(SHAPE.regions)[:, None] * SHAPE.num_blocks
    return ((region + local[order][None, :]).ravel().astype(np.int32),
            (region + remote[order][None, :]).ravel().astype(np.int32))


def _batch(variant: str, prefill: _Side, decode: _Side, rids: list[str], src: np.ndarray,
           dst: np.ndarray, period: float) -> dict[str, Any]:
    """One batch of ``len(rids)`` requests of ``variant``; CPU by side and thread kind."""
    n = len(rids)
    p, d = prefill.worker, decode.worker
    mode, _, c = variant.partition("_")
    api = "c" if c == "c" else "python"
    prefill.active = decode.active = api if mode in ("push", "pull") else ""
    if mode == FLOOR:
        prefill.active = decode.active = api = FLOOR
    # Only the C API's pair counts: the other pair's idle wake-ups do not belong to a batch.
    released = -_released_ns(p, d) if api == "c" else 0
    before = (prefill.snapshot(), decode.snapshot())
    t0 = time.monotonic() + 0.1
    timeout = n * period + WAIT_S + 30
    if variant == "floor_push":
        local, remote = _raw_indices("WRITE", src, dst)
        d.send_call(_M + "side_expect", rids=rids, ids=dst, t0=t0, period=period, api=api)
        p.send_call(_M + "side_prefill_done", rids=rids, ids=src, t0=t0, period=period,
                    api=api, local=local, remote=remote)
    elif variant == "floor_pull":
        local, remote = _raw_indices("READ", src, dst)
        d.send_call(_M + "side_floor_pull", rids=rids, local=local, remote=remote, t0=t0,
                    period=period)
        p.send_call(_M + "side_wait", rids=rids)
    elif mode == "push":
        d.send_call(_M + "side_expect", rids=rids, ids=dst, t0=t0, period=period, api=api)
        p.send_call(_M + "side_prefill_done", rids=rids, ids=src, t0=t0, period=period,
                    api=api)
    elif mode == "pull":
        tickets, inside = p.call(_M + "side_tickets", rids=rids, ids=src, api=api)
        d.send_call(_M + "side_pull", rids=rids, tickets=tickets, ids=dst, t0=t0,
                    period=period, api=api)
        p.send_call(_M + "side_wait", rids=rids)
    else:
        op = "WRITE" if "write" in variant else "READ"
        notif = variant.endswith("_notif")
        initiator, target = (p, d) if op == "WRITE" else (d, p)
        local, remote = _raw_indices(op, src, dst)
        if notif:
            target.send_call(_M + "side_raw_listen", t0=t0, period=period, n=n)
        initiator.send_call(_M + "side_raw_post", op=op, local=local, remote=remote, t0=t0,
                            period=period, n=n, notif=notif)
        if not notif:
            target.send_call(_M + "side_wait", rids=[])
    inside_d = d.result(timeout)
    inside_p = p.result(timeout)
    if mode == "pull":
        inside_p = inside
    after = (prefill.snapshot(), decode.snapshot())
    released += _released_ns(p, d) if api == "c" else 0
    return {"p": prefill.delta(before[0], after[0]), "d": decode.delta(before[1], after[1]),
            "inside_ns": 1e9 * (inside_p + inside_d), "released_ns": released}


def _released_ns(*workers: Worker) -> int:
    return sum(int(w.call(_M + "side_released_ns")) for w in workers)


def _accumulate(slot: dict[str, Any], res: dict[str, Any], n: int) -> None:
    slot["n"] = slot.get("n", 0) + n
    slot["inside_ns"] = slot.get("inside_ns", 0.0) + res["inside_ns"]
    slot["released_ns"] = slot.get("released_ns", 0) + res["released_ns"]
    for side in "pd":
        for kind, (cpu, rq) in res[side].items():
            slot[f"{side}_{kind}"] = slot.get(f"{side}_{kind}", 0) + cpu
            slot[f"{side}_{kind}_rq"] = slot.get(f"{side}_{kind}_rq", 0) + rq


def _row(variant: str, size: str, slot: dict[str, Any]) -> dict[str, Any]:
    k = slot["n"]
    row: dict[str, Any] = {"variant": variant, "size": size, "requests": k}
    for side in "pd":
        for kind in KINDS:
            row[f"{side}_{kind}_us"] = slot[f"{side}_{kind}"] / 1e3 / k
            row[f"{side}_{kind}_rq_us"] = slot[f"{side}_{kind}_rq"] / 1e3 / k
    row["cpu_us"] = sum(row[f"{s}_{kind}_us"] for s in "pd" for kind in KINDS)
    row["inside_us"] = slot["inside_ns"] / 1e3 / k
    if variant.partition("_")[0] in ("push", "pull"):
        # Over the C API, what kvpush's threads spent inside NIXL without the GIL is known
        # (a post's copy, mostly) and comes off; over the binding it cannot be told apart.
        row["released_us"] = slot["released_ns"] / 1e3 / k
        row["gil_us"] = (row["p_loop_us"] + row["d_loop_us"] + row["inside_us"]
                         - row["released_us"])
        row["gil_rq_us"] = row["p_loop_rq_us"] + row["d_loop_rq_us"]
    for key, value in slot.items():   # the attribution pass: per request
        side, _, rest = key.partition("_split_")
        if rest:
            row[f"{side}_{rest}"] = value / k
    return row


def period_s(size: str) -> float:
    """Seconds between a batch's requests: more than one takes on a shared 2-core host."""
    return 5e-3 if SIZES[size] <= 16 else 25e-3


def run(quick: bool, progress: bool = True, requests: int | None = None,
        rounds: int | None = None, idle_s: float | None = None,
        sizes: tuple[str, ...] = tuple(SIZES), split_size: str = "1mib",
        policy: str = "default") -> dict[str, Any]:
    """``requests`` per (variant, size), in ``rounds`` batches each, the variants taking
    turns; then the attribution pass (:func:`side_split`) of push and pull at
    ``split_size``, ``requests`` each. ``policy``: the endpoints' progress policy
    (:data:`POLICIES`)."""
    _policy(policy)
    requests = requests or (20 if quick else 200)
    rounds = rounds or (2 if quick else 4)
    idle_s = idle_s if idle_s is not None else (2.0 if quick else 10.0)
    per_batch = max(1, requests // rounds)
    bar = Progress("cpu-per-request", 6 + rounds * len(sizes), progress)
    pw, dw = Worker("cpr-prefill"), Worker("cpr-decode")
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    split: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"requests_per_variant": per_batch * rounds, "policy": policy,
                           "load_avg_start": os.getloadavg()}
    try:
        a = pw.call(_M + "side_setup", role="prefill", policy=policy, timeout=120)
        b = dw.call(_M + "side_setup", role="decode", address=a["address"], policy=policy,
                    timeout=120)
        pw.call("benchmarks.hot_path:side_raw_connect", md=b["raw_md"], bases=b["bases"])
        dw.call("benchmarks.hot_path:side_raw_connect", md=a["raw_md"], bases=a["bases"])
        out["progress"] = {"prefill": a["progress"], "decode": b["progress"]}
        prefill, decode = _Side(pw, a), _Side(dw, b)
        rng = np.random.default_rng(0)
        ids = {size: (rng.choice(SHAPE.num_blocks, nb, replace=False).astype(np.int64),
                      rng.choice(SHAPE.num_blocks, nb, replace=False).astype(np.int64))
               for size, nb in SIZES.items()}
        n = 0

        def batch(variant: str, size: str, count: int) -> dict[str, Any]:
            nonlocal n
            rids = [f"cpr-{n + i}" for i in range(count)]
            n += count
            return _batch(variant, prefill, decode, rids, *ids[size], period_s(size))

        for size in sizes:  # connections, caches and code paths warm before anything counts
            for variant in VARIANTS:
                batch(variant, size, 2)
        bar.step("engines up, warm")
        # -- idle: one pair's loops count ------------------------------------------------
        prefill.active = decode.active = "python"
        time.sleep(0.5)
        before = (prefill.snapshot(), decode.snapshot())
        t_idle = time.monotonic()
        time.sleep(idle_s)
        elapsed = time.monotonic() - t_idle
        after = (prefill.snapshot(), decode.snapshot())
        idle = {"p": prefill.delta(before[0], after[0]), "d": decode.delta(before[1], after[1])}
        out["idle_us_per_s"] = {f"{side}_{kind}": cpu / 1e3 / elapsed
                                for side in "pd" for kind, (cpu, _) in idle[side].items()}
        out["cpu_us_per_idle_s"] = sum(out["idle_us_per_s"].values())
        bar.step(f"idle: {out['cpu_us_per_idle_s']:.0f} us/s")
        # -- requests ----------------------------------------------------------------------
        for r in range(rounds):
            for size in sizes:
                for variant in VARIANTS:
                    _accumulate(acc.setdefault((variant, size), {}),
                                batch(variant, size, per_batch), per_batch)
                bar.step(f"round {r + 1} {size}")
        # -- attribution: the loop threads' NIXL calls, core and sends apart ---------------
        for variant in ("push", "pull", "push_c", "pull_c"):
            api = "c" if variant.endswith("_c") else "python"
            for w in (pw, dw):
                w.call(_M + "side_split", on=True, api=api)
            slot = split.setdefault(variant, {})
            for _ in range(rounds):
                _accumulate(slot, batch(variant, split_size, per_batch), per_batch)
            for side, w in (("p", pw), ("d", dw)):
                got = w.call(_M + "side_split", on=False, api=api)
                for part in PARTS:
                    slot[f"{side}_split_{part}"] = got[f"{part}_ns"] / 1e3
                    slot[f"{side}_split_{part}_calls"] = got[f"{part}_calls"]
                slot[f"{side}_split_wakeups"] = got["wakeups"]
                slot[f"{side}_split_hot_polls"] = got["hot_polls"]
            bar.step(f"attribution {variant} {split_size}")
        out["load_avg_end"] = os.getloadavg()
    finally:
        stop_all([dw, pw])
        bar.finish()
    out["rows"] = [_row(variant, size, slot) for (variant, size), slot in acc.items()]
    out["split_size"] = split_size
    out["split_rows"] = [_row(variant, split_size, slot) for variant, slot in split.items()]
    out["summary"] = _summary(out["rows"], out["cpu_us_per_idle_s"])
    return out


def _summary(rows: list[dict[str, Any]], idle: float) -> dict[str, float]:
    by = {(r["variant"], r["size"]): r for r in rows}
    summary: dict[str, float] = {}
    raw_names = {"raw_write": "raw_nixl", "raw_read": "raw_nixl_read",
                 "raw_write_notif": "raw_nixl_notif", "raw_read_notif": "raw_nixl_read_notif"}
    for (variant, size), row in by.items():
        if variant in raw_names:
            summary[f"{raw_names[variant]}_cpu_us_per_request_{size}"] = row["cpu_us"]
            continue
        if variant.startswith(FLOOR):
            mode = variant.partition("_")[2]
            summary[f"floor_cpu_us_per_request_{mode}_{size}"] = row["cpu_us"]
            raw = by.get(("raw_write" if mode == "push" else "raw_read", size))
            if raw is not None:
                summary[f"floor_over_raw_nixl_{mode}_{size}"] = row["cpu_us"] / raw["cpu_us"]
            kvpush_row = by.get((mode, size))
            if kvpush_row is not None:
                summary[f"cpu_per_request_{mode}_over_floor_{size}"] = (kvpush_row["cpu_us"]
                                                                        / row["cpu_us"])
            continue
        mode = variant.partition("_")[0]
        summary[f"cpu_us_per_request_{variant}_{size}"] = row["cpu_us"]
        summary[f"gil_us_per_request_{variant}_{size}"] = row["gil_us"]
        raw = by.get(("raw_write" if mode == "push" else "raw_read", size))
        if raw is not None:
            summary[f"cpu_per_request_{variant}_over_raw_nixl_{size}"] = (row["cpu_us"]
                                                                          / raw["cpu_us"])
        binding = by.get((mode, size))
        if variant.endswith("_c") and binding is not None:
            summary[f"nixl_c_over_binding_cpu_{mode}_{size}"] = (row["cpu_us"]
                                                                 / binding["cpu_us"])
        if size == "1mib":
            summary[f"gil_us_per_request_{variant}"] = row["gil_us"]
    summary["cpu_us_per_idle_s"] = idle
    return summary


def table(result: dict[str, Any]) -> str:
    """CPU us per request by variant and size, split by process and thread kind
    (p_: prefill process, d_: decode process); the attribution pass; idle CPU."""
    cols = [f"{s}_{k}_us" for s in "pd" for k in KINDS]
    lines = ["CPU us per request, by process (p_ prefill, d_ decode) and thread kind", "",
             "| variant | size | " + " | ".join(c[:-3] for c in cols)
             + " | total | GIL (loop run-queue) | in NIXL without the GIL |",
             "|" + "---|" * (len(cols) + 5)]
    order = {v: i for i, v in enumerate(VARIANTS)}
    sizes = list(SIZES)
    for r in sorted(result["rows"], key=lambda r: (sizes.index(r["size"]),
                                                   order[r["variant"]])):
        gil = f"{r['gil_us']:.0f} ({r['gil_rq_us']:.0f})" if "gil_us" in r else "-"
        released = f"{r['released_us']:.0f}" if r.get("released_us") else "-"
        lines.append(f"| {r['variant']} | {r['size']} | "
                     + " | ".join(f"{r[c]:.0f}" for c in cols)
                     + f" | {r['cpu_us']:.0f} | {gil} | {released} |")
    lines += ["", f"Where kvpush's CPU goes at {result['split_size']}, us per request (calls "
              "per request in brackets): the loop thread's CPU inside its agent's NIXL calls "
              "(the binding or C API, UCX, the copy), its protocol core's methods and its "
              "message sends (encoding, ZeroMQ), the rest of the loop (waiting, polling, "
              "timers, decoding, callbacks); its wake-ups and spinning iterations", "",
              "| variant | side | engine thread | loop | NIXL | core | sends | loop rest "
              "| wake-ups | spins | ZeroMQ I/O | total |", "|" + "---|" * 12]
    for r in result["split_rows"]:
        for side, label in (("p", "prefill"), ("d", "decode")):
            parts = {p: r.get(f"{side}_{p}", 0.0) for p in PARTS}
            calls = {p: r.get(f"{side}_{p}_calls", 0.0) for p in PARTS}
            loop = r[f"{side}_loop_us"]
            lines.append(
                f"| {r['variant']} | {label} | {r[f'{side}_engine_us']:.0f} | {loop:.0f} | "
                + " | ".join(f"{parts[p]:.0f} ({calls[p]:.1f})" for p in PARTS)
                + f" | {loop - sum(parts.values()):.0f} | {r.get(f'{side}_wakeups', 0):.1f} | "
                f"{r.get(f'{side}_hot_polls', 0):.1f} | {r[f'{side}_zmq_us']:.0f} | "
                f"{sum(r[f'{side}_{k}_us'] for k in KINDS):.0f} |")
        lines.append(f"| {r['variant']} | engine threads inside kvpush calls, both | "
                     f"{r['inside_us']:.0f} |" + " |" * 9)
    idle = result["idle_us_per_s"]
    lines += ["", "CPU per idle second, one endpoint pair, both processes: "
              f"{result['cpu_us_per_idle_s']:.0f} us ("
              + ", ".join(f"{k} {v:.0f}" for k, v in idle.items() if v >= 0.5) + ")"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    ap.add_argument("--split-size", choices=sorted(SIZES), default="1mib",
                    help="the request size of the attribution pass")
    ap.add_argument("--policy", choices=POLICIES, default="default",
                    help="the endpoints' progress policy (kvpush.ProgressPolicy or a preset)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = run(args.quick, requests=args.requests, sizes=tuple(args.sizes),
              split_size=args.split_size, policy=args.policy)
    print(table(out))
    print(f"load average: start {out['load_avg_start']}, end {out['load_avg_end']}")
    save_json(out, args.json)


if __name__ == "__main__":
    main()
