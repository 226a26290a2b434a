"""``kvpush doctor``: is NIXL usable here, and which path do kvpush's transfers take?

It reports

* versions (kvpush, its compiled core, NIXL, UCX, numpy, Python);
* the NIXL backend plugins this install ships, whether each can load here, and the memory
  kinds each takes (``DRAM_SEG``, ``VRAM_SEG``, ``FILE_SEG`` ...);
* a **loopback pair**: two child processes, each with one NIXL agent configured exactly as
  kvpush configures its own (:class:`kvpush.agent.Agent`: progress thread off, UCX error
  mode from :class:`kvpush.TransportConfig`), WRITE and READ a few MiB between them and check
  the bytes. Both children run with ``UCX_LOG_LEVEL=info`` and ``UCX_PROTO_INFO=y``; the
  doctor parses what UCX prints -- the transports of each endpoint configuration
  (``intra-node cfg#1 rma(sysv/memory posix/memory) am(...)``) and of the protocols chosen
  for ``ucp_put`` / ``ucp_get`` (e.g. ``zero-copy cma/memory``) -- and the bandwidth seen,
  next to a one-thread memcpy of the same bytes.

It also times this host's **wake-ups**, the floor of kvpush's fixed cost per request (a
request hands work between threads and processes several times; on a VM a core that went
idle answers slowly): a Python thread blocked in ``select`` woken through an eventfd (as
kvpush's loop thread is by the engine's) and answering, and a ZeroMQ ROUTER/DEALER round
trip to a child process (each message crosses both sides' I/O threads), each after 2 ms
idle, as between an engine's requests.

Warnings, in plain words, when the path is slower than it should be: RMA over TCP or
emulated over active messages between two processes of one host (shared memory / CMA were
possible: UCX error mode ``peer`` or ``UCX_TLS`` does this), or bandwidth far below memcpy.

Exit status: 0 healthy; 2 works, with warnings; 1 broken (NIXL missing, no UCX, the
loopback transfer failed or moved wrong bytes), with the reason on the last line.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import enum
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Level", "Report", "main", "parse_ucx_output"]

_TAG = "@kvpush-doctor "
_BLOCK = 1 << 20


class Level(enum.Enum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"


@dataclass
class Finding:
    level: Level
    topic: str
    message: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, level: Level, topic: str, message: str) -> None:
        self.findings.append(Finding(level, topic, message))

    @property
    def exit_code(self) -> int:
        levels = {f.level for f in self.findings}
        if Level.FAIL in levels:
            return 1
        if Level.WARN in levels:
            return 2
        return 0

    def render(self) -> str:
        marks = {Level.OK: "ok  ", Level.INFO: "    ", Level.WARN: "WARN", Level.FAIL: "FAIL"}
        lines = [f"[{marks[f.level]}] {f.topic}: {f.message}" for f in self.findings]
        code = self.exit_code
        if code == 0:
            lines.append("healthy: kvpush can move KV blocks here on the expected path")
        elif code == 2:
            warns = [f.topic for f in self.findings if f.level is Level.WARN]
            lines.append(f"works, with warnings ({', '.join(warns)}): see WARN lines above")
        else:
            fails = [f"{f.topic}: {f.message}" for f in self.findings if f.level is Level.FAIL]
            lines.append("BROKEN: " + "; ".join(fails))
        return "\n".join(lines)


# -- UCX output -----------------------------------------------------------------------------
_VERSION_RE = re.compile(r"UCX\s+INFO\s+Version\s+(\S+)")
_EP_RE = re.compile(r"UCX\s+INFO\s+(\S+)\s+(self|intra-node|inter-node)\s+cfg#(\d+)\s+(.*)$")
_LANE_RE = re.compile(r"(\w+)\(([^)]*)\)")
_TABLE_LINE_RE = re.compile(r"\]\s+\|(.*)\|\s*$")
_TABLE_RULE_RE = re.compile(r"\]\s+\+[-+]+\+\s*$")


def parse_ucx_output(text: str) -> dict[str, Any]:
    """Pull what matters out of ``UCX_LOG_LEVEL=info`` + ``UCX_PROTO_INFO=y`` output.

    Returns ``{"version": str | None, "endpoints": [{"agent", "scope", "cfg", "lanes":
    {"rma": [...], "am": [...], ...}}], "protocols": {"put": [...], "get": [...]}}`` where
    protocols lists the ``(range, description, transport)`` rows of the intra-/inter-node
    tables for remote memory write (``ucp_put``) and read (``ucp_get``).
    """
    version = None
    endpoints: list[dict[str, Any]] = []
    protocols: dict[str, list[tuple[str, str, str]]] = {"put": [], "get": []}
    table: list[str] = []
    for line in text.splitlines():
        m = _VERSION_RE.search(line)
        if m:
            version = m.group(1)
            continue
        m = _EP_RE.search(line)
        if m:
            lanes = {k: v.split() for k, v in _LANE_RE.findall(m.group(4))}
            endpoints.append({"agent": m.group(1), "scope": m.group(2), "cfg": int(m.group(3)),
                              "lanes": lanes})
            continue
        m = _TABLE_LINE_RE.search(line)
        if m:
            if "cfg#" in m.group(1) and table:  # a new table's title row
                _take_table(table, protocols)
                table = []
            table.append(m.group(1))
            continue
        if _TABLE_RULE_RE.search(line):
            continue
        if table:
            _take_table(table, protocols)
            table = []
    if table:
        _take_table(table, protocols)
    return {"version": version, "endpoints": endpoints, "protocols": protocols}


def _take_table(rows: list[str], protocols: dict[str, list[tuple[str, str, str]]]) -> None:
    """One PROTO_INFO table: a title row naming the endpoint config, one naming the
    operation, a header, then ``| range | description | transport |`` rows."""
    if len(rows) < 3 or "self" in rows[0].split():
        return  # loopback to the process itself: not the path between two processes
    title = rows[1]
    if "remote memory write by ucp_put" in title:
        op = "put"
    elif "remote memory read by ucp_get" in title:
        op = "get"
    else:
        return
    for row in rows[2:]:
        cells = [c.strip() for c in row.split("|")]
        if len(cells) == 3 and cells[0] and cells[0] != "Range":
            entry = (cells[0], cells[1], cells[2])
            if entry not in protocols[op]:
                protocols[op].append(entry)


def _transports(entries: Sequence[str]) -> set[str]:
    """``"cma/memory"`` -> ``"cma"``; ``"tcp/lo"`` -> ``"tcp"``."""
    return {e.split("/")[0] for e in entries if e}


# -- checks in this process -------------------------------------------------------------------
def _versions(report: Report) -> None:
    import importlib.metadata as md

    from . import __version__

    report.data["kvpush"] = __version__
    report.add(Level.INFO, "kvpush", f"{__version__} (Python {sys.version.split()[0]})")
    try:
        from . import _core

        build = "debug" if getattr(_core, "DEBUG", False) else "release"
        report.add(Level.OK, "compiled core", f"kvpush._core loaded ({build} build)")
    except ImportError as exc:  # pragma: no cover - kvpush's own import needs it today
        report.add(Level.FAIL, "compiled core", f"kvpush._core does not import: {exc}")
    for dist in ("nixl", "numpy", "pyzmq", "msgspec"):
        try:
            report.data[dist] = md.version(dist)
        except md.PackageNotFoundError:
            report.data[dist] = None
    if report.data["nixl"] is None:
        report.add(Level.FAIL, "nixl", "the nixl package is not installed (pip install nixl)")
    else:
        report.add(Level.INFO, "versions", f"nixl {report.data['nixl']}, numpy "
                   f"{report.data['numpy']}, pyzmq {report.data['pyzmq']}, msgspec "
                   f"{report.data['msgspec']}")


def _plugins(report: Report) -> bool:
    """List NIXL's plugins and memory kinds; False when NIXL cannot make an agent."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # NIXL logs a traceback per plugin it cannot load
    try:
        try:
            import nixl._api as api
        except Exception as exc:
            report.add(Level.FAIL, "nixl", f"cannot import nixl: {type(exc).__name__}: {exc}")
            return False
        try:
            conf = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                         backends=[])
            agent = api.nixl_agent(f"kvpush-doctor-{os.getpid()}", conf)
        except Exception as exc:
            report.add(Level.FAIL, "nixl", f"cannot create a NIXL agent: {exc}")
            return False
        plugins: dict[str, list[str]] = {}
        for name in agent.get_plugin_list():
            try:
                plugins[str(name)] = [str(k) for k in agent.get_plugin_mem_types(name)]
            except Exception:
                plugins[str(name)] = []
        report.data["plugins"] = plugins
        usable = {k: v for k, v in plugins.items() if v}
        unusable = sorted(k for k, v in plugins.items() if not v)
        report.add(Level.INFO, "plugins", ", ".join(
            f"{k} [{' '.join(v)}]" for k, v in sorted(usable.items())) or "none loadable")
        if unusable:
            report.add(Level.INFO, "plugins not loadable here",
                       ", ".join(unusable) + " (their libraries or devices are absent)")
        if "UCX" not in usable:
            report.add(Level.FAIL, "UCX", "NIXL's UCX plugin is missing or cannot load; "
                       "kvpush needs it")
            return False
        try:
            agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
            mems = [str(k) for k in agent.get_backend_mem_types("UCX")]
            params = {str(k): str(v) for k, v in agent.get_plugin_params("UCX").items()}
        except Exception as exc:
            report.add(Level.FAIL, "UCX", f"cannot create the UCX backend: {exc}")
            return False
        report.data["ucx_backend_mem_types"] = mems
        report.data["ucx_params"] = params
        report.add(Level.OK, "UCX backend", f"created; takes {' '.join(mems)}; plugin "
                   "defaults " + ", ".join(f"{k}={v or '-'}" for k, v in sorted(params.items()))
                   + " (kvpush sets ucx_error_handling_mode from TransportConfig: none)")
        del agent
        return True
    finally:
        logging.disable(previous)


# -- the loopback pair --------------------------------------------------------------------------
class _Child:
    """A doctor child process; its output is read by a thread so no wait can hang."""

    def __init__(self, role: str, args: list[str], env: dict[str, str]) -> None:
        self.role = role
        cmd = [sys.executable, "-m", "kvpush.doctor", "--child", role, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        for line in out:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def expect(self, timeout: float) -> dict[str, Any]:
        """The child's next tagged message (JSON)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role} child said nothing within {timeout:.0f} s")
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.role} child exited (status {self.proc.wait(5)}):\n"
                                   + "\n".join(self.lines[-15:]))
            if line.startswith(_TAG):
                msg: dict[str, Any] = json.loads(line[len(_TAG):])
                if "error" in msg:
                    raise RuntimeError(f"{self.role} child: {msg['error']}")
                return msg

    def send(self, msg: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(msg) + "\n")
        stdin.flush()

    def stop(self, timeout: float = 10.0) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait(5)
        self._reader.join(5)


def _loopback(report: Report, error_mode: str, nbytes: int, timeout: float) -> None:
    env = dict(os.environ)
    env.update({"UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "y", "NIXL_LOG_LEVEL": "ERROR"})
    args = ["--error-mode", error_mode, "--bytes", str(nbytes)]
    # Both start at once (imports take seconds); the initiator waits for the target's info.
    target = _Child("target", args, env)
    initiator: _Child | None = _Child("initiator", args, env)
    try:
        info = target.expect(timeout)
        assert initiator is not None
        initiator.send(info)
        result = initiator.expect(timeout)
    except (TimeoutError, RuntimeError, json.JSONDecodeError) as exc:
        report.add(Level.FAIL, "loopback transfer", str(exc))
        return
    finally:
        if initiator is not None:
            initiator.stop()
        target.stop()
    text = "\n".join(target.lines + (initiator.lines if initiator else []))
    ucx = parse_ucx_output(text)
    report.data["loopback"] = result
    report.data["ucx"] = ucx
    if ucx["version"]:
        report.add(Level.INFO, "UCX", f"{ucx['version']} (as loaded by NIXL)")
    if not result.get("bytes_ok"):
        report.add(Level.FAIL, "loopback transfer", "bytes read back differ from bytes written")
        return
    mib = nbytes / (1 << 20)
    w, r, mc = result["write_gbps"], result["read_gbps"], result["memcpy_gbps"]
    report.add(Level.OK, "loopback transfer",
               f"2 processes, {mib:.0f} MiB in 1 MiB blocks, bytes checked: WRITE {w:.2f} GB/s, "
               f"READ {r:.2f} GB/s (memcpy of the same bytes, one thread: {mc:.2f} GB/s); "
               f"64 scattered 4 KiB blocks: {result['small_write_us']:.0f} us per WRITE")
    eps = [e for e in ucx["endpoints"] if e["scope"] != "self"]
    for ep in eps[:2]:
        lanes = " ".join(f"{k}({' '.join(v)})" for k, v in ep["lanes"].items())
        report.add(Level.INFO, "UCX endpoint", f"{ep['agent']} {ep['scope']}: {lanes}")
    put = _transports([t for _, _, t in ucx["protocols"]["put"]])
    get = _transports([t for _, _, t in ucx["protocols"]["get"]])
    if put or get:
        report.add(Level.INFO, "UCX protocols", "WRITE (ucp_put): " + _rows(
            ucx["protocols"]["put"]) + "; READ (ucp_get): " + _rows(ucx["protocols"]["get"]))
    rma = set()
    emulated = False
    for ep in eps:
        rma |= _transports(ep["lanes"].get("rma", []))
        if "rma_am" in ep["lanes"]:
            emulated = True
            rma |= _transports(ep["lanes"]["rma_am"])
    selected = rma | put | get
    if not eps:
        report.add(Level.WARN, "transport", "UCX printed no endpoint configuration: cannot "
                   "tell which transports were selected")
    elif emulated or "tcp" in rma:
        how = ("is emulated over active messages on " + ", ".join(sorted(rma))
               + " (every WRITE/READ needs the target to progress and takes round trips"
               " over it)") if emulated else "goes over TCP"
        cause = ("ucx_error_handling_mode=peer; TransportConfig(ucx_error_mode='none'), "
                 "kvpush's default, lets UCX use sysv/posix/cma" if error_mode == "peer" else
                 "UCX_TLS or the UCX build excludes shared-memory transports here")
        report.add(Level.WARN, "transport",
                   f"RMA between two processes of this host {how}, where shared-memory RMA "
                   f"was possible. Cause: {cause}.")
    elif selected & {"cma", "sysv", "posix", "knem", "xpmem"}:
        report.add(Level.OK, "transport", "shared memory / CMA between processes ("
                   + ", ".join(sorted(selected)) + ")")
    if mc > 0 and max(w, r) < 0.2 * mc:
        report.add(Level.WARN, "bandwidth",
                   f"loopback WRITE/READ reach {max(w, r) / mc:.0%} of a one-thread memcpy; "
                   "expected about half or more on a host (a busy machine also does this)")


#: A thread wake-up (after idle) slower than this p50 is a warning: the host looks
#: oversubscribed.
SLOW_WAKE_US = 500.0


#: The echoing child of the ZeroMQ round trip: a DEALER that sends back what it gets, and
#: exits when told, when its parent's socket is gone, or after 30 s.
_ECHO = """
import sys, zmq
ctx = zmq.Context(); d = ctx.socket(zmq.DEALER); d.setsockopt(zmq.LINGER, 0)
d.connect(sys.argv[1]); d.send(b"hello")
while d.poll(30000):
    m = d.recv()
    if m == b"bye":
        break
    d.send(m)
d.close(0); ctx.term()
"""


def _wakeups(report: Report, samples: int = 150, idle_s: float = 0.002) -> None:
    """Time a thread wake-up (eventfd) and a ZeroMQ round trip to a child process, each
    after ``idle_s`` of idle; an INFO line, or WARN when a wake-up is slow."""
    import numpy as np
    import zmq

    efd = os.eventfd(0, os.EFD_CLOEXEC)
    woke = threading.Event()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    stop = threading.Event()
    times: dict[str, list[float]] = {}
    sleeper_thread: threading.Thread | None = None
    echo: subprocess.Popen[bytes] | None = None
    ident: bytes | None = None

    def sleeper() -> None:
        while True:
            select.select([efd], [], [], 5.0)
            if stop.is_set():
                return
            os.eventfd_read(efd)
            woke.set()

    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        echo = subprocess.Popen([sys.executable, "-c", _ECHO, f"tcp://127.0.0.1:{port}"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        if not router.poll(30000):
            raise TimeoutError("the echoing child did not connect within 30 s")
        ident, _ = router.recv_multipart()
        sleeper_thread = threading.Thread(target=sleeper, daemon=True)
        sleeper_thread.start()
        wake = times.setdefault("thread_wake_us", [])
        for _ in range(samples):
            time.sleep(idle_s)
            woke.clear()
            t0 = time.perf_counter()
            os.eventfd_write(efd, 1)
            if not woke.wait(5.0):
                raise TimeoutError("a woken thread did not run within 5 s")
            wake.append(time.perf_counter() - t0)
        trip = times.setdefault("zmq_round_trip_us", [])
        for _ in range(samples):
            time.sleep(idle_s)
            t0 = time.perf_counter()
            router.send_multipart([ident, b"x" * 64])
            if not router.poll(5000):
                raise TimeoutError("no ZeroMQ answer within 5 s")
            router.recv_multipart()
            trip.append(time.perf_counter() - t0)
    except (OSError, zmq.ZMQError, TimeoutError) as exc:
        report.add(Level.WARN, "wake-ups", f"could not time them: {exc}")
        return
    finally:
        stop.set()
        os.eventfd_write(efd, 1)
        if sleeper_thread is not None:
            sleeper_thread.join(5)
        if echo is not None:
            if ident is not None:
                with contextlib.suppress(zmq.ZMQError):
                    router.send_multipart([ident, b"bye"], zmq.NOBLOCK)
            try:
                echo.wait(5)
            except subprocess.TimeoutExpired:
                echo.kill()  # our own child, by its handle
                echo.wait(5)
        router.close(0)
        ctx.term()
        os.close(efd)
    p50 = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    report.data["wakeups"] = p50
    text = (f"after {idle_s * 1e3:g} ms idle, a thread woken through an eventfd answers in "
            f"{p50['thread_wake_us']:.0f} us p50 and a ZeroMQ round trip to another process "
            f"takes {p50['zmq_round_trip_us']:.0f} us: a request hands off between threads "
            f"and processes several times, so these set the floor of kvpush's fixed cost "
            f"per request (docs/BENCHMARKS.md)")
    slow = p50["thread_wake_us"] > SLOW_WAKE_US
    report.add(Level.WARN if slow else Level.INFO, "wake-ups",
               text + ("; slow: the host looks oversubscribed" if slow else ""))


def _rows(rows: list[tuple[str, str, str]]) -> str:
    return ", ".join(f"{rng} {desc} {tl}" for rng, desc, tl in rows) or "not printed"


# -- child processes ----------------------------------------------------------------------------
def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(_TAG + json.dumps(msg) + "\n")
    sys.stdout.flush()


def _layout(buf: Any, block: int) -> Any:
    from .layout import KVLayout, Region

    # One region, 1 layer, K+V packed, 1 head of 64 fp16: 256 bytes per token.
    return KVLayout(regions=(Region(int(buf.ctypes.data), int(buf.nbytes)),), num_layers=1,
                    num_blocks=int(buf.nbytes) // block, tokens_per_block=block // 256,
                    num_kv_heads=1, head_size=64, dtype="float16", kv_packed=True)


def _pattern(n: int, salt: int) -> Any:
    import numpy as np

    return ((np.arange(n, dtype=np.uint32) * 7 + salt) % 251).astype(np.uint8)


def _child(role: str, error_mode: str, nbytes: int) -> int:
    try:
        return _child_main(role, error_mode, nbytes)
    except Exception as exc:
        _emit({"error": f"{type(exc).__name__}: {exc}"})
        return 1


def _child_main(role: str, error_mode: str, nbytes: int) -> int:
    import msgspec
    import numpy as np

    from .agent import Agent, TransportConfig, XferState
    from .layout import KVLayout, LayoutWire

    transport = TransportConfig(ucx_error_mode=error_mode)
    if role == "target":
        buf = _pattern(nbytes, 11)
        agent = Agent(f"doctor-target-{os.getpid()}", _layout(buf, _BLOCK), transport)
        small = _layout(buf, 4096)
        _emit({"metadata": base64.b64encode(agent.metadata()).decode(),
               "layout": msgspec.json.encode(_layout(buf, _BLOCK).to_wire()).decode(),
               "small_layout": msgspec.json.encode(small.to_wire()).decode()})
        # Serve until the parent closes stdin; progress the agent meanwhile (with UCX error
        # mode "peer", RMA needs the target's progress).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sys.stdin], [], [], 0.001)
            if ready and not sys.stdin.readline():
                break
            agent.notifications()
        agent.close()
        return 0

    info = json.loads(sys.stdin.readline())
    remote = KVLayout.from_wire(msgspec.json.decode(info["layout"].encode(), type=LayoutWire))
    remote_small = KVLayout.from_wire(msgspec.json.decode(info["small_layout"].encode(),
                                                          type=LayoutWire))
    mine = _pattern(2 * nbytes, 23)  # [0, n): WRITE source; [n, 2n): READ destination
    expected_target = _pattern(nbytes, 11)
    agent = Agent(f"doctor-initiator-{os.getpid()}", _layout(mine, _BLOCK), transport)
    peer = agent.add_peer(base64.b64decode(info["metadata"]), remote)
    n = nbytes // _BLOCK

    def xfer(op: str, local_idx: Any, remote_idx: Any, ag: Any = agent, to: str = peer
             ) -> float:
        t0 = time.perf_counter()
        handle = ag.post(op, to, np.asarray(local_idx, dtype=np.int32),
                         np.asarray(remote_idx, dtype=np.int32), b"")
        while True:
            state = ag.state(handle)
            if state is XferState.DONE:
                break
            if state is XferState.ERROR:
                raise RuntimeError(f"{op} failed")
            if time.perf_counter() - t0 > 30:
                raise TimeoutError(f"{op} not done after 30 s")
        dt = time.perf_counter() - t0
        ag.release(handle)
        return dt

    ids = np.arange(n)
    reads = [xfer("READ", n + ids, ids) for _ in range(4)]
    bytes_ok = bool(np.array_equal(mine[nbytes:], expected_target))
    writes = [xfer("WRITE", ids, ids) for _ in range(4)]
    mine[nbytes:] = 0
    xfer("READ", n + ids, ids)  # read back what was written
    bytes_ok = bytes_ok and bool(np.array_equal(mine[nbytes:], mine[:nbytes]))
    tmp = np.empty(nbytes, dtype=np.uint8)
    tmp.fill(0)
    copies = []
    for _ in range(4):
        t0 = time.perf_counter()
        np.copyto(tmp, mine[:nbytes])
        copies.append(time.perf_counter() - t0)
    # Small scattered blocks: per-descriptor cost, the usual limit for KV blocks.
    small = Agent(f"doctor-small-{os.getpid()}", _layout(mine, 4096), transport)
    small_peer = small.add_peer(base64.b64decode(info["metadata"]), remote_small)
    rng = np.random.default_rng(0)
    small_times = []
    for _ in range(5):
        loc = np.sort(rng.choice(2 * nbytes // 4096, 64, replace=False))
        rem = rng.choice(nbytes // 4096, 64, replace=False)
        small_times.append(xfer("WRITE", loc, rem, small, small_peer))
    small.close()
    agent.close()
    best = min
    _emit({"write_gbps": nbytes / best(writes[1:]) / 1e9,
           "read_gbps": nbytes / best(reads[1:]) / 1e9,
           "memcpy_gbps": nbytes / best(copies[1:]) / 1e9,
           "small_write_us": float(np.median(small_times[1:])) * 1e6,
           "bytes_ok": bytes_ok})
    return 0


# -- entry point ----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush doctor", description=(
        "Check NIXL, its plugins and the transport kvpush's transfers take on this host."))
    ap.add_argument("--error-mode", choices=("none", "peer"), default="none",
                    help="UCX error-handling mode to test (kvpush's default: none)")
    ap.add_argument("--bytes", type=int, default=16 << 20,
                    help="bytes per loopback transfer (default 16 MiB)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for each child process")
    ap.add_argument("--json", action="store_true", help="print the findings as JSON")
    ap.add_argument("--child", choices=("target", "initiator"), help=argparse.SUPPRESS)
    args = ap.parse_args(list(argv) if argv is not None else None)
    nbytes = max(_BLOCK, args.bytes // _BLOCK * _BLOCK)
    if args.child:
        return _child(args.child, args.error_mode, nbytes)
    report = Report()
    _versions(report)
    if report.exit_code != 1 and _plugins(report):
        _loopback(report, args.error_mode, nbytes, args.timeout)
    if report.exit_code != 1:
        _wakeups(report)
    if args.json:
        print(json.dumps({"exit_code": report.exit_code,
                          "findings": [{"level": f.level.value, "topic": f.topic,
                                        "message": f.message} for f in report.findings],
                          "data": report.data}, indent=1, default=str))
    else:
        print(report.render())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
