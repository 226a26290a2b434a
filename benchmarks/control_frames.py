"""CPU per control frame: ZeroMQ (how kvpush sends its control frames today) against a
plain stream socket that the loop thread reads and writes itself.

kvpush's control frames (a registration, the ``Posted`` hint, a ``PullDone``) go over
ZeroMQ DEALER/ROUTER sockets. libzmq moves every frame through an I/O thread on each side:
the sender's thread queues it and wakes its I/O thread, which writes the TCP socket; the
receiver's I/O thread reads it and wakes the receiving thread. For an isolated frame (an
engine's request, not a stream) each of those hops is a thread wake-up.
``benchmarks.cpu_per_request`` counts that I/O thread's CPU per request (``zmq``); this
measures what the same frames cost without it.

Two spawned processes: the initiator sends a frame of ``--size`` bytes, the other side
(its thread blocked in ``poll``) reads it and sends it back; the initiator waits for the
answer in ``poll``, sleeps ``--gap-ms`` (so every frame starts from idle, as a request's
do), and goes again, ``--frames`` times. CPU is every thread of both processes
(``/proc/self/task/*/schedstat``, counted by each process around its own frames), per frame
(a round trip is two), split into the threads that send and receive (``main``), ZeroMQ's
I/O threads (``zmq_io``) and the rest. Transports, in turns for ``--rounds`` rounds:

* ``zmq_tcp`` -- DEALER to ROUTER over TCP loopback, with kvpush's control-socket options;
* ``tcp`` -- a TCP loopback connection (``TCP_NODELAY``), each frame one ``send``;
* ``unix`` -- a Unix stream socket, the same way.

The figures include the initiator's sleep and wake-up between frames (the same in every
transport). ``python -m benchmarks.control_frames [--frames N] [--rounds R] [--json PATH]``
"""

from __future__ import annotations

import argparse
import multiprocessing.connection as mpc
import os
import select
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import zmq

from kvpush.driver import control_socket

from ._common import Progress, save_json
from ._procs import Worker, stop_all, thread_schedstats

__all__ = ["TRANSPORTS", "measure", "round_trips", "run", "table"]

TRANSPORTS = ("zmq_tcp", "tcp", "unix")
WAIT_S = 10.0   # the longest wait for any one frame


def _cpu_by_kind() -> dict[str, int]:
    """This process's CPU ns so far by thread kind: ``main`` (the thread that sends and
    receives), ``zmq_io`` (libzmq's I/O threads, ``ZMQbg/IO/*``), ``other``."""
    out = {"main": 0, "zmq_io": 0, "other": 0}
    stats = thread_schedstats()
    if stats is None:
        raise RuntimeError("this kernel keeps no per-thread schedstat")
    for tid, (name, ran, _) in stats.items():
        kind = "main" if tid == os.getpid() else \
            "zmq_io" if name.startswith("ZMQbg/IO") else "other"
        out[kind] += ran
    return out


def _since(before: dict[str, int]) -> dict[str, int]:
    now = _cpu_by_kind()
    return {k: now[k] - before[k] for k in now}


class _Stream:
    """One end of a plain stream socket, read and written by the calling thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    def send(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def recv(self, size: int) -> None:
        got = 0
        while got < size:
            if not self.poller.poll(int(WAIT_S * 1e3)):
                raise TimeoutError("no frame within the wait")
            chunk = self.sock.recv(size - got)
            if not chunk:
                raise ConnectionError("the other side closed")
            got += len(chunk)

    def close(self) -> None:
        self.sock.close()


class _Zmq:
    """A DEALER (initiator) or ROUTER (the other side) with kvpush's socket options."""

    def __init__(self, sock: zmq.Socket[Any], context: zmq.Context[Any]) -> None:
        self.sock, self.context = sock, context
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.peer: bytes | None = None

    def send(self, frame: bytes) -> None:
        if self.peer is None:
            self.sock.send(frame)
        else:
            self.sock.send_multipart([self.peer, frame])

    def recv(self, size: int) -> None:
        if not self.poller.poll(int(WAIT_S * 1e3)):
            raise TimeoutError("no frame within the wait")
        if self.sock.type == zmq.ROUTER:
            self.peer, _ = self.sock.recv_multipart()
        else:
            self.sock.recv()

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def side_listen(state: dict[str, Any], conn: mpc.Connection, transport: str) -> str:
    """The answering side: bind a listener for ``transport``; returns its address."""
    if transport == "zmq_tcp":
        context: zmq.Context[Any] = zmq.Context()
        sock = context.socket(zmq.ROUTER)
        control_socket(sock, 10.0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        state["end"] = _Zmq(sock, context)
        return f"tcp://127.0.0.1:{port}"
    if transport == "tcp":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{listener.getsockname()[1]}"
    elif transport == "unix":
        folder = tempfile.mkdtemp(prefix="kvpush-frames-")
        state["folder"] = folder
        state["cleanup"].append(lambda: shutil.rmtree(folder, ignore_errors=True))
        address = os.path.join(folder, "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
    else:
        raise ValueError(f"unknown transport {transport!r}; one of {TRANSPORTS}")
    listener.listen(1)
    listener.settimeout(WAIT_S)
    state["listener"] = listener
    return address


def side_connect(state: dict[str, Any], conn: mpc.Connection, transport: str,
                 address: str, size: int) -> None:
    """The initiator: connect to ``address`` and send the first frame (the other side
    answers it before it starts counting)."""
    if transport == "zmq_tcp":
        context: zmq.Context[Any] = zmq.Context()
        sock = context.socket(zmq.DEALER)
        control_socket(sock, 10.0)
        sock.connect(address)
        end: _Zmq | _Stream = _Zmq(sock, context)
    elif transport == "tcp":
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=WAIT_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        end = _Stream(s)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(WAIT_S)
        s.connect(address)
        end = _Stream(s)
    state["end"] = end
    end.send(b"x" * size)


def side_answer(state: dict[str, Any], conn: mpc.Connection, frames: int,
                size: int) -> dict[str, int]:
    """The answering side: take the connection (streams), answer the first frame, then
    ``frames`` more, counting CPU over the latter."""
    if "listener" in state:
        listener = state.pop("listener")
        s, _ = listener.accept()
        listener.close()
        if s.family == socket.AF_INET:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state["end"] = _Stream(s)
    end = state["end"]
    frame = b"x" * size
    end.recv(size)
    end.send(frame)
    before = _cpu_by_kind()
    for _ in range(frames):
        end.recv(size)
        end.send(frame)
    return _since(before)


def side_ask(state: dict[str, Any], conn: mpc.Connection, frames: int, size: int,
             gap_s: float) -> dict[str, int]:
    """The initiator: take the first frame's answer, then ``frames`` round trips, each
    after a ``gap_s`` sleep, counting CPU over them."""
    end = state["end"]
    frame = b"x" * size
    end.recv(size)
    before = _cpu_by_kind()
    for _ in range(frames):
        time.sleep(gap_s)
        end.send(frame)
        end.recv(size)
    return _since(before)


def side_close(state: dict[str, Any], conn: mpc.Connection) -> None:
    end = state.pop("end", None)
    if end is not None:
        end.close()
    folder = state.pop("folder", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


_M = "benchmarks.control_frames:"


def round_trips(ask: Worker, answer: Worker, transport: str, frames: int, size: int,
                gap_s: float) -> dict[str, float]:
    """``frames`` round trips over ``transport``, ``gap_s`` apart, between ``ask``'s and
    ``answer``'s threads: CPU us per frame by thread kind, every thread of both processes."""
    address = answer.call(_M + "side_listen", transport=transport)
    try:
        ask.call(_M + "side_connect", transport=transport, address=address, size=size)
        answer.send_call(_M + "side_answer", frames=frames, size=size)
        got_ask = ask.call(_M + "side_ask", timeout=frames * (gap_s + WAIT_S) + 60,
                           frames=frames, size=size, gap_s=gap_s)
        got_answer = answer.result(WAIT_S + 60)
    finally:
        for w in (ask, answer):
            w.call(_M + "side_close")
    per = 2 * frames   # a round trip is two frames
    out = {f"{kind}_us": (got_ask[kind] + got_answer[kind]) / per / 1e3 for kind in got_ask}
    out["initiator_us"] = sum(got_ask.values()) / per / 1e3
    out["answerer_us"] = sum(got_answer.values()) / per / 1e3
    out["total_us"] = out["initiator_us"] + out["answerer_us"]
    return out


def measure(frames: int = 400, rounds: int = 3, size: int = 128, gap_s: float = 0.002,
            transports: tuple[str, ...] = TRANSPORTS,
            progress: bool = True) -> dict[str, Any]:
    """Each transport ``rounds`` times, in turns; per transport the median of each figure
    over the rounds (CPU us per frame) and every round's total."""
    if frames < 1 or rounds < 1 or size < 1 or gap_s < 0:
        raise ValueError("frames, rounds and size must be >= 1, gap_s >= 0")
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}; choose from {TRANSPORTS}")
    bar = Progress("control_frames", rounds * len(transports), progress)
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    workers = [Worker("frames-initiator"), Worker("frames-answerer")]
    try:
        for r in range(rounds):
            for t in transports:
                runs[t].append(round_trips(workers[0], workers[1], t, frames, size, gap_s))
                bar.step(f"round {r + 1} {t}")
    finally:
        bar.finish()
        stop_all(workers)
    rows = []
    for t, got in runs.items():
        row: dict[str, Any] = {"transport": t}
        for key in got[0]:
            row[key] = statistics.median(g[key] for g in got)
        row["runs_total_us"] = [round(g["total_us"], 1) for g in got]
        rows.append(row)
    return {"frames": frames, "rounds": rounds, "size": size, "gap_s": gap_s,
            "load_average": os.getloadavg(), "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [f"CPU us per control frame ({result['size']} B, {result['frames']} round trips "
             f"{result['gap_s'] * 1e3:g} ms apart, median of {result['rounds']} rounds), "
             "every thread of both processes", "",
             "| transport | total | initiator | answerer | main threads | ZeroMQ I/O | other "
             "| each round's total |", "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(
            f"| {row['transport']} | {row['total_us']:.0f} | {row['initiator_us']:.0f} | "
            f"{row['answerer_us']:.0f} | {row['main_us']:.0f} | {row['zmq_io_us']:.0f} | "
            f"{row['other_us']:.0f} | {', '.join(f'{v:.0f}' for v in row['runs_total_us'])} |")
    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    lines.append(f"load average at the end: {load}")
    return "\n".join(lines)


def run(quick: bool = False, progress: bool = True, **kwargs: Any) -> dict[str, Any]:
    if quick:
        kwargs.setdefault("frames", 100)
        kwargs.setdefault("rounds", 1)
    return measure(progress=progress, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=400, help="round trips per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=128, help="bytes per frame")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="idle time between frames")
    ap.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    result = measure(frames=args.frames, rounds=args.rounds, size=args.size,
                     gap_s=args.gap_ms / 1e3, transports=tuple(args.transports))
    print(table(result))
    save_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
