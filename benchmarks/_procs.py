"""Child processes for the benchmarks: a spawned worker that runs named functions on request.

A :class:`Worker` is one spawned Python process. :meth:`Worker.call` runs
``module:function(state, conn, **kwargs)`` there and returns its result; ``state`` is a dict
that lives as long as the process (buffers, NIXL agents, kvpush endpoints), ``conn`` is the
pipe, for functions that stream messages (the engines of the critical-path benchmark).
Every wait has a timeout; :meth:`Worker.close` asks the child to clean up, then kills it by
its pid if it has not exited. A child whose parent goes quiet for ``idle_exit_s`` exits.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RemoteError", "Worker", "clock_ticks", "cpu_seconds", "run_queue_waits",
           "thread_schedstats"]


class RemoteError(RuntimeError):
    """A function run in a worker raised; the message holds the child's traceback."""


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s live threads, to the nanosecond (their schedstat
    run times: utime + stime count whole clock ticks, 10 ms here, so a 10 s window of an
    idle pair read 0.0, 0.1 or 0.2 % by the tick). A thread that has ended no longer
    counts: read it over windows where the threads live on. Where the kernel keeps no
    schedstat, utime + stime of the whole process."""
    stats = thread_schedstats(pid)
    if stats is None:
        return _stat_cpu_seconds(f"/proc/{pid}/stat")
    return sum(ran for _, ran, _ in stats.values()) / 1e9


def thread_schedstats(pid: int | str = "self") -> dict[int, tuple[str, int, int]] | None:
    """Every live thread of process ``pid`` (default: this one): native id -> (its command
    name, nanoseconds it has run on a CPU, nanoseconds it has spent runnable but waiting
    for one), from Linux's ``/proc/PID/task/*/schedstat``; None where the kernel does not
    keep them or the process is gone."""
    out: dict[int, tuple[str, int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                ran, waited = (int(x) for x in f.read().split()[:2])
            with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
                name = f.read().decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError):
            continue   # the thread ended meanwhile
        except (OSError, IndexError, ValueError):
            return None
        out[int(tid)] = (name, ran, waited)
    return out


def run_queue_waits() -> dict[int, tuple[str, int]] | None:
    """Every live thread of this process: native id -> (its command name, nanoseconds it
    has spent runnable but waiting for a CPU); None where the kernel does not keep them."""
    stats = thread_schedstats()
    return None if stats is None else {
        tid: (name, waited) for tid, (name, _, waited) in stats.items()}


def _stat_cpu_seconds(path: str) -> float:
    with open(path, "rb") as f:
        data = f.read()
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = data[data.rindex(b")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / clock_ticks()


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def _worker_main(conn: mpc.Connection, env: dict[str, str], idle_exit_s: float) -> None:
    os.environ.update(env)
    state: dict[str, Any] = {"cleanup": []}
    try:
        while conn.poll(idle_exit_s):
            msg = conn.recv()
            if msg[0] == "exit":
                break
            _, path, kwargs = msg
            try:
                result = _resolve(path)(state, conn, **kwargs)
            except BaseException as exc:  # reported to the parent, which raises
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            else:
                conn.send(("ok", result))
    finally:
        # Close endpoints / agents in reverse order of creation.
        for fn in reversed(state["cleanup"]):
            try:
                fn()
            except Exception:
                traceback.print_exc()
        with contextlib.suppress(OSError, ValueError):
            conn.send(("exited", None))


class Worker:
    """A spawned child process that runs benchmark functions.

    Parameters
    ----------
    name
        For messages.
    env
        Environment variables set in the child before anything runs there.
    start_timeout
        Seconds to wait for the child to come up.
    """

    def __init__(self, name: str, env: dict[str, str] | None = None,
                 start_timeout: float = 60.0, idle_exit_s: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, env or {}, idle_exit_s),
                                   name=name, daemon=True)
        self.process.start()
        child.close()
        # The first answer is the ping's: workers started together come up in parallel, and
        # the first real call waits for it (see :meth:`result`).
        self._start_timeout = start_timeout
        self._starting = True
        self.send_call("benchmarks._procs:ping")

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def send_call(self, path: str, **kwargs: Any) -> None:
        """Start ``path`` in the child; collect its result with :meth:`result`."""
        if getattr(self, "_starting", False) and path != "benchmarks._procs:ping":
            self.wait_started()
        self.conn.send(("call", path, kwargs))

    def wait_started(self) -> None:
        """Wait for the child to come up (done by the first :meth:`result` anyway)."""
        if self._starting:
            self._starting = False
            try:
                self.result(self._start_timeout)
            except BaseException:
                self.kill()
                raise

    def result(self, timeout: float) -> Any:
        self.wait_started()
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "error":
            raise RemoteError(f"{self.name}: {value}")
        if status != "ok":
            raise RemoteError(f"{self.name}: unexpected reply {status!r}")
        return value

    def call(self, path: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        """Run ``path`` (``"module:function"``) in the child and return its result."""
        self.send_call(path, **kwargs)
        return self.result(timeout)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def kill(self) -> None:
        if self.process.is_alive() and self.process.pid:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self, timeout: float = 20.0) -> None:
        """Ask the child to clean up and exit; kill it (by pid) if it does not."""
        if self.process.is_alive():
            try:
                self.conn.send(("exit",))
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self.process.is_alive():
                    if self.conn.poll(0.05):
                        try:
                            if self.conn.recv()[0] == "exited":
                                break
                        except EOFError:
                            break
                self.process.join(max(0.1, deadline - time.monotonic()))
            except (OSError, ValueError, EOFError):
                pass
        self.kill()
        self.conn.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ping(state: dict[str, Any], conn: mpc.Connection) -> int:
    return os.getpid()


def stop_all(workers: list[Worker]) -> None:
    """Close every worker, each with its own timeout; never raises."""
    for w in workers:
        try:
            w.close()
        except Exception:
            traceback.print_exc()
