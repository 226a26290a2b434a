"""Shared pieces: progress line, statistics, KV layouts over numpy buffers, block-id
patterns, and a raw NIXL agent (no kvpush) configured either the way kvpush does or with
NIXL's defaults."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "KIB",
    "MIB",
    "HandoffHelper",
    "Progress",
    "RawAgent",
    "block_ids",
    "descriptor_table",
    "fmt_bytes",
    "geomean",
    "open_endpoint",
    "pct",
    "single_region_layout",
    "wake_penalty",
]

KIB = 1024
MIB = 1024 * 1024


# -- the hand-off floors -------------------------------------------------------------------
class HandoffHelper:
    """A second thread of an engine's process running one job at a time and sleeping in
    between (a blocking queue read, as kvpush's loop thread sleeps in ``epoll_wait``): the
    hand-off floors of ``benchmarks.throughput`` and ``benchmarks.busy_engine``: the least
    that handing work to such a thread and being woken when it is done costs. ``run`` waits
    for its job to end and re-raises what it raised."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="handoff-helper", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def run(self, job: Callable[[], None], timeout: float = 30.0) -> None:
        done = threading.Event()
        failed: list[BaseException] = []

        def wrapped() -> None:
            try:
                job()
            except BaseException as exc:  # re-raised on the caller's thread
                failed.append(exc)
            finally:
                done.set()

        self._jobs.put(wrapped)
        if not done.wait(timeout):
            raise TimeoutError(f"hand-off helper: job not done in {timeout} s")
        if failed:
            raise failed[0]

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5.0)
        if self._thread.is_alive():
            raise RuntimeError("hand-off helper thread did not stop")


# -- the host's wake penalty ---------------------------------------------------------------
#: iterations of :func:`_python_work`: about 100 us of pure Python on the 2-core host, hot
WAKE_WORK_ITERS = 700


def _python_work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i ^ (i >> 3)
    return total


def wake_penalty(samples: int = 200, idle_s: float = 0.002,
                 iters: int = WAKE_WORK_ITERS) -> dict[str, float]:
    """What a thread that slept pays to run a fixed piece of Python (``iters`` of a loop,
    about 100 us hot): its p50 run right after an ``idle_s`` sleep against its p50 run back
    to back. No kvpush, no NIXL. Every request of an engine integration wakes several such
    threads (the engine's, the loop threads of both sides, ZeroMQ's I/O threads), each
    running its share of the hand-over cold; a raw NIXL loop polled back to back wakes
    none. Samples alternate (hot, cold, hot, ...), so a slow phase of a shared host hits
    both alike. Returns ``hot_us_p50``, ``cold_us_p50`` and ``penalty_us_p50`` (cold -
    hot)."""
    hot: list[float] = []
    cold: list[float] = []
    for _ in range(samples):
        _python_work(iters)  # warm: the next run is back to back
        t0 = time.perf_counter()
        _python_work(iters)
        hot.append(time.perf_counter() - t0)
        time.sleep(idle_s)
        t0 = time.perf_counter()
        _python_work(iters)
        cold.append(time.perf_counter() - t0)
    hot_p50, cold_p50 = float(np.median(hot)) * 1e6, float(np.median(cold)) * 1e6
    return {"hot_us_p50": hot_p50, "cold_us_p50": cold_p50,
            "penalty_us_p50": cold_p50 - hot_p50}


# -- progress -------------------------------------------------------------------------------
class Progress:
    """One stderr line per suite: ``[suite] 3/12 label (4.1 s)``; rewritten in place on a
    terminal, one line per step otherwise (so logs of long runs show where they are)."""

    def __init__(self, suite: str, total: int, enabled: bool = True) -> None:
        self.suite = suite
        self.total = max(total, 1)
        self.done = 0
        self.t0 = time.monotonic()
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        self.show(label)

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = (f"[{self.suite}] [{bar}] {self.done}/{self.total} {label} "
                f"({time.monotonic() - self.t0:.1f} s)")
        if self.tty:
            sys.stderr.write("\r\x1b[2K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# -- statistics -----------------------------------------------------------------------------
def open_endpoint(state: dict[str, Any], role: str, layout: Any, address: str = "",
                  **kwargs: Any) -> str:
    """A benchmark worker's kvpush endpoint, kept in its ``state`` (``"endpoint"``, closed by
    its cleanup): ``prefill`` makes a Producer and returns its address; any other role a
    Consumer connected to ``address``, and returns the producer's name (also
    ``state["producer"]``). ``kwargs`` go to the endpoint (config, callbacks)."""
    import kvpush

    endpoint: Any = (kvpush.Producer if role == "prefill" else kvpush.Consumer)(layout, **kwargs)
    state["endpoint"] = endpoint
    state["cleanup"].append(endpoint.close)
    if role == "prefill":
        return str(endpoint.address)
    name: str = endpoint.connect(address, timeout=30)
    state["producer"] = name
    return name


def evictor(mib: int) -> Callable[[], None]:
    """A numpy copy of ``mib`` MiB between two buffers made here, which leaves the CPU caches
    cold, as an engine's forward pass does (a call that does nothing for 0)."""
    if mib < 0:
        raise ValueError(f"evict_mib must be >= 0, got {mib}")
    if not mib:
        return lambda: None
    src = np.ones(mib * MIB, dtype=np.uint8)
    return functools.partial(np.copyto, np.empty_like(src), src)


def save_json(out: Any, path: str) -> None:
    """Write a benchmark's result to ``path`` as indented JSON (nothing if ``path`` is empty:
    the scripts' ``--json`` default)."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def geomean(values: Sequence[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return float(math.exp(sum(math.log(v) for v in vals) / len(vals))) if vals else math.nan


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# -- layouts and block ids ------------------------------------------------------------------
def single_region_layout(buffer: np.ndarray, block_bytes: int) -> Any:
    """A one-region kvpush layout over ``buffer`` with blocks of ``block_bytes`` (one layer,
    K and V packed, 1 KV head of 64 fp16 elements: 256 bytes per token)."""
    import kvpush

    if block_bytes % 256:
        raise ValueError("block_bytes must be a multiple of 256")
    num_blocks = buffer.nbytes // block_bytes
    view = buffer[: num_blocks * block_bytes]
    return kvpush.KVLayout(
        regions=(kvpush.Region(view.ctypes.data, view.nbytes),), num_layers=1,
        num_blocks=num_blocks, tokens_per_block=block_bytes // 256, num_kv_heads=1,
        head_size=64, dtype="float16", kv_packed=True)


def descriptor_table(bases: Sequence[int], num_blocks: int, block_bytes: int,
                     stride: int | None = None) -> np.ndarray:
    """Region-major (address, length, device) rows, index ``r * num_blocks + b`` -- the same
    table kvpush prepares (``KVLayout.descriptor_table``)."""
    stride = stride or block_bytes
    base = np.asarray(bases, dtype=np.uint64)
    offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride)
    table = np.zeros((len(bases) * num_blocks, 3), dtype=np.uint64)
    table[:, 0] = (base[:, None] + offsets[None, :]).ravel()
    table[:, 1] = block_bytes
    return table


def block_ids(order: str, n: int, src_blocks: int, dst_blocks: int, seed: int,
              run: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination ids of one request of ``n`` blocks.

    ``in_order``: blocks 0..n-1 on both sides (one contiguous run).
    ``scattered``: distinct random blocks on each side, random pairing (almost no runs).
    ``runs``: runs of ``run`` blocks adjacent on *both* sides, placed at random, and the
    pairs listed in random order (as a block table after churn may list them): NIXL merges
    only neighbours in list order, so only a planner that reorders recovers the runs.
    ``runs_ordered``: the same runs listed run by run (NIXL merges them by itself).
    """
    rng = np.random.default_rng(seed)
    if order == "in_order":
        ids = np.arange(n, dtype=np.int64)
        return ids, ids.copy()
    if order == "scattered":
        return (rng.choice(src_blocks, n, replace=False).astype(np.int64),
                rng.choice(dst_blocks, n, replace=False).astype(np.int64))
    if order in ("runs", "runs_ordered"):
        run = max(1, min(run, n))
        nruns = -(-n // run)
        src_slots = rng.choice(src_blocks // run, nruns, replace=False)
        dst_slots = rng.choice(dst_blocks // run, nruns, replace=False)
        within = np.arange(run, dtype=np.int64)
        src = (src_slots[:, None] * run + within[None, :]).ravel()[:n]
        dst = (dst_slots[:, None] * run + within[None, :]).ravel()[:n]
        if order == "runs":
            perm = rng.permutation(n)
            src, dst = src[perm], dst[perm]
        return src.astype(np.int64), dst.astype(np.int64)
    raise ValueError(f"unknown block order {order!r}")


def sorted_pairs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ordered by local id: the descriptor order kvpush's planner posts (runs become
    neighbours), computed here in numpy so raw NIXL gets the very same descriptors."""
    order = np.argsort(local, kind="stable")
    return local[order], remote[order]


# -- raw NIXL -------------------------------------------------------------------------------
def _nixl_api() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import nixl._api as api

    logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


class RawAgent:
    """One NIXL agent used directly (no kvpush).

    ``config="kvpush"``: progress thread off, ``ucx_error_handling_mode=none`` -- what
    :class:`kvpush.agent.Agent` does. ``config="default"``: ``nixl_agent(name)`` with NIXL's
    defaults (UCX backend, error mode ``peer``, progress thread on, polling without pause).
    """

    def __init__(self, name: str, config: str) -> None:
        api = _nixl_api()
        self.name = name
        self.config = config
        if config == "kvpush":
            conf = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                         backends=[])
            self.agent = api.nixl_agent(name, conf)
            self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        elif config == "default":
            self.agent = api.nixl_agent(name)
        else:
            raise ValueError(f"unknown raw NIXL config {config!r}")
        self._regs: list[Any] = []
        self._dlists: list[Any] = []
        self.peers: list[str] = []

    def register(self, buffers: Sequence[np.ndarray]) -> None:
        self._regs.append(self.agent.register_memory(
            [(b.ctypes.data, b.nbytes, 0, "") for b in buffers], "DRAM"))

    def metadata(self) -> bytes:
        data: bytes = self.agent.get_agent_metadata()
        return data

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.peers.append(name)
        return str(name)

    def prep(self, peer: str, table: np.ndarray) -> Any:
        """Prepare a descriptor list; ``peer="NIXL_INIT_AGENT"`` for the local side."""
        handle = self.agent.prep_xfer_dlist(peer, table, "DRAM")
        self._dlists.append(handle)
        return handle

    def xfer(self, op: str, local: Any, local_idx: np.ndarray, remote: Any,
             remote_idx: np.ndarray, notif: bytes = b"", poll_sleep: float = 0.0) -> float:
        """Post one transfer and wait for it at the initiator (polling ``check_xfer_state``
        back-to-back, or sleeping ``poll_sleep`` between polls); returns its seconds."""
        t0 = time.perf_counter()
        handle, state = self.post(op, local, local_idx, remote, remote_idx, notif)
        return self.wait(op, handle, state, t0, poll_sleep) - t0

    def post(self, op: str, local: Any, local_idx: np.ndarray, remote: Any,
             remote_idx: np.ndarray, notif: bytes = b"") -> tuple[Any, str]:
        """``make_prepped_xfer`` + ``transfer``: the handle and its first state."""
        handle = self.agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
        return handle, self.agent.transfer(handle)

    def wait(self, op: str, handle: Any, state: str, t0: float, poll_sleep: float = 0.0
             ) -> float:
        """Poll a posted transfer to its end (30 s after ``t0`` at most), then release it;
        returns the ``perf_counter`` time it was seen done."""
        deadline = t0 + 30.0
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError(f"raw NIXL {op} failed")
            if poll_sleep:
                time.sleep(poll_sleep)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"raw NIXL {op} not done in 30 s")
            state = self.agent.check_xfer_state(handle)
        done = time.perf_counter()
        handle.release()
        return done

    def close(self) -> None:
        for handle in self._dlists:
            with contextlib.suppress(Exception):
                handle.release()
        self._dlists.clear()
        for peer in self.peers:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(peer)
        self.peers.clear()
        for reg in self._regs:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
        self._regs.clear()
        # Dropping the last reference stops the agent (and its progress thread, if any).
        self.agent = None
