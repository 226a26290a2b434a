"""A kvpush Producer or Consumer in its own process, driven by one JSON object per line on
stdin, answering one JSON object per line on stdout (see :class:`tests.support.netns.Node`).

Run as ``ip netns exec NS python -m tests.support.netns_node`` (or without ``ip netns exec``). The
real stdout is kept for the protocol only: fd 1 is pointed at stderr, so anything NIXL, UCX
or a library prints can never corrupt an answer. The node dies with its parent
(``PR_SET_PDEATHSIG``) and when stdin closes, so it cannot outlive a test.

Commands (``{"seq": n, "cmd": name, "args": {...}}``):

* ``start``: ``role`` (producer | consumer), ``cache`` (``harness.make_cache`` kwargs),
  ``seed`` (producer: fill pattern), ``config`` (ProducerConfig / ConsumerConfig fields;
  ``auth_key`` base64, ``transport`` a dict). Answers ``{name, address}``.
* producer: ``prefill`` (``items``: [rid, src ids, "push"|"pull"]; answers a base64 ticket,
  null, or ``{"error": ...}`` per item), ``abort`` (``rids``), ``released``, ``state``.
* consumer: ``connect``, ``expect`` / ``pull`` (``items``; the destination blocks are
  scrubbed to the canary first, and the node remembers which source bytes must land there),
  ``abort`` (``rids``), ``results`` (each READY result is checked byte for byte against the
  producer's pattern: ``corrupted`` counts differing bytes), ``producers``.
* both: ``stats``, ``info`` (pid, RSS, fds, threads), ``close`` (close the endpoint, report
  what is still live), ``exit`` (close, answer that report, exit).
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

import kvpush
from kvpush.messages import PullTicket, decode_ids
from kvpush.metrics import LIVE
from tests.support.harness import CANARY, Cache, fill, make_cache

SCRIBBLE = 0x5A  # what a producer's engine writes into source blocks it got back


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


class NodeState:
    def __init__(self) -> None:
        self.endpoint: Any = None
        self.role = ""
        self.cache: Cache | None = None
        self.cache_kwargs: dict[str, Any] = {}
        self.refs: dict[int, Cache] = {}
        # consumer: rid -> (dst ids, src ids, producer seed) to check on READY
        self.expected: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}
        # consumer, with scrub_on_result: destination blocks are painted with the canary
        # again once their request is reported (as if the engine reused them), and bytes
        # found there when they are handed out again landed after the report
        self.scrub_on_result = False
        self.late_bytes = 0
        # bytes found in blocks of a blocks_safe=False result when their quarantine ends
        # (they landed during it, as that result warned they might)
        self.quarantine_bytes = 0
        # producer: released blocks a transfer may still read, reused once the time comes
        self.reuse_later: list[tuple[float, Any]] = []
        # blocks back from a quarantine, and bytes found in them when handed out again
        self.was_quarantined: set[int] = set()
        self.late_bytes_after_quarantine = 0
        # producer, with scrub_on_release: released source blocks are scribbled over (the
        # engine reuses them) and get their pattern back when handed over again, so a
        # transfer still reading them after their release delivers wrong bytes
        self.scrub_on_release = False
        self.seed = 0

    # -- helpers ---------------------------------------------------------------------------
    def ref(self, seed: int) -> Cache:
        """The bytes a producer filled with ``seed`` holds (same geometry as ours). The last
        few are kept: restarted producers bring new seeds, and a soak must not mistake this
        cache for a leak."""
        ref = self.refs.pop(seed, None)
        if ref is None:
            ref = make_cache(**{**self.cache_kwargs, "shared": False})  # never registered
            fill(ref, seed)
        self.refs[seed] = ref  # most recently used last
        while len(self.refs) > 4:
            del self.refs[next(iter(self.refs))]
        return ref

    def scrub(self, dst: np.ndarray) -> None:
        assert self.cache is not None
        for buf in self.cache.buffers:
            buf[dst] = CANARY

    def allocate(self, dst: np.ndarray) -> None:
        """Blocks handed to a new request: count late bytes (see ``scrub_on_result``)."""
        assert self.cache is not None
        if self.scrub_on_result:
            back = np.array([b in self.was_quarantined for b in dst.tolist()], dtype=bool)
            for buf in self.cache.buffers:
                late = buf[dst] != CANARY
                self.late_bytes += int(np.count_nonzero(late[~back]))
                self.late_bytes_after_quarantine += int(np.count_nonzero(late[back]))
            self.was_quarantined.difference_update(dst.tolist())
        self.scrub(dst)

    def corrupted(self, rid: str) -> int:
        """Bytes of ``rid``'s destination blocks that differ from its source blocks."""
        dst, src, seed = self.expected[rid]
        assert self.cache is not None
        ref = self.ref(seed)
        bad = 0
        for got, want in zip(self.cache.buffers, ref.buffers, strict=True):
            bad += int(np.count_nonzero(got[dst] != want[src]))
        return bad

    # -- commands --------------------------------------------------------------------------
    def start(self, role: str, cache: dict[str, Any], seed: int = 1,
              config: dict[str, Any] | None = None, scrub_on_result: bool = False,
              scrub_on_release: bool = False) -> dict[str, str]:
        self.scrub_on_result = scrub_on_result
        self.scrub_on_release = scrub_on_release
        self.seed = seed
        config = dict(config or {})
        if config.get("auth_key"):
            config["auth_key"] = base64.b64decode(config["auth_key"])
        if "transport" in config:
            config["transport"] = kvpush.TransportConfig(**config["transport"])
        self.cache_kwargs = cache
        self.cache = make_cache(**cache)
        self.role = role
        if role == "producer":
            fill(self.cache, seed)
            self.endpoint = kvpush.Producer(self.cache.layout, kvpush.ProducerConfig(**config))
            return {"name": self.endpoint.name, "address": self.endpoint.address}
        for buf in self.cache.buffers:
            buf[:] = CANARY
        self.endpoint = kvpush.Consumer(self.cache.layout, kvpush.ConsumerConfig(**config))
        return {"name": self.endpoint.name, "address": ""}

    def prefill(self, items: list[list[Any]]) -> list[Any]:
        out: list[Any] = []
        assert self.cache is not None
        for rid, src, mode in items:
            ids = np.asarray(src, dtype=np.int64)
            if self.scrub_on_release and len(ids) and ids.min() >= 0 \
                    and ids.max() < self.cache.layout.num_blocks:
                for got, want in zip(self.cache.buffers, self.ref(self.seed).buffers,
                                     strict=True):
                    got[ids] = want[ids]
            try:
                ticket = self.endpoint.prefill_done(rid, ids, kvpush.TransferMode(mode))
            except kvpush.KvpushError as exc:
                out.append({"error": f"{type(exc).__name__}: {exc}"})
                continue
            out.append(base64.b64encode(ticket.to_bytes()).decode() if ticket else None)
        return out

    def connect(self, address: str, timeout: float = 10.0) -> str:
        name: str = self.endpoint.connect(address, timeout=timeout)
        return name

    def expect(self, items: list[list[Any]]) -> list[str | None]:
        """items: [rid, dst, producer name(s), timeout, seed, src]."""
        out: list[str | None] = []
        for rid, dst, producers, timeout, seed, src in items:
            dst_ids = np.asarray(dst, dtype=np.int64)
            self.allocate(dst_ids)
            self.expected[rid] = (dst_ids, np.asarray(src, dtype=np.int64), seed)
            try:
                self.endpoint.expect(rid, dst_ids, producers, timeout=timeout)
            except kvpush.KvpushError as exc:
                self.expected.pop(rid, None)
                out.append(f"{type(exc).__name__}: {exc}")
            else:
                out.append(None)
        return out

    def pull(self, items: list[list[Any]]) -> list[str | None]:
        """items: [rid, base64 ticket, dst, timeout, seed]."""
        out: list[str | None] = []
        for rid, ticket_b64, dst, timeout, seed in items:
            dst_ids = np.asarray(dst, dtype=np.int64)
            ticket = PullTicket.from_bytes(base64.b64decode(ticket_b64))
            self.allocate(dst_ids)
            self.expected[rid] = (dst_ids, decode_ids(ticket.block_ids).copy(), seed)
            try:
                self.endpoint.pull(ticket, dst_ids, timeout=timeout)
            except kvpush.KvpushError as exc:
                self.expected.pop(rid, None)
                out.append(f"{type(exc).__name__}: {exc}")
            else:
                out.append(None)
        return out

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.endpoint.abort(rid)

    def results(self) -> list[dict[str, Any]]:
        out = []
        for r in self.endpoint.get_finished():
            corrupted = self.corrupted(r.request_id) \
                if r.ok and r.request_id in self.expected else 0
            mine = self.expected.pop(r.request_id, None)
            if self.scrub_on_result and mine is not None:
                self.scrub(mine[0])
            out.append({"rid": r.request_id, "state": r.state.value, "mode": r.mode.value,
                        "error": type(r.error).__name__ if r.error else None,
                        "detail": str(r.error) if r.error else "",
                        "elapsed": r.elapsed_s, "corrupted": corrupted,
                        "safe": r.blocks_safe})
        return out

    def released(self) -> list[list[Any]]:
        out = self.endpoint.get_released()
        if self.scrub_on_release:  # the engine reuses the blocks it got back
            assert self.cache is not None
            now = time.monotonic()
            # blocks_safe=False: a transfer may still read them; reused only after a while
            self.reuse_later += [(now + r.quarantine_s, r.block_ids) for r in out
                                 if not r.blocks_safe]
            due = [r.block_ids for r in out if r.blocks_safe] + [
                ids for t, ids in self.reuse_later if t <= now]
            self.reuse_later = [(t, ids) for t, ids in self.reuse_later if t > now]
            for ids in due:
                for buf in self.cache.buffers:
                    buf[ids] = SCRIBBLE
        return [[r.request_id, r.reason.value, len(r.block_ids), r.detail] for r in out]

    def state(self, rid: str) -> str:
        st: str = self.endpoint._driver.call_and_wait(lambda: self.endpoint._debug_state(rid), 5.0)
        return st

    def producers(self) -> list[str]:
        names: list[str] = self.endpoint.producers()
        return names

    def nixl_peers(self) -> list[str]:
        """Remote agents whose metadata and descriptor lists the NIXL agent still holds."""
        agent = self.endpoint._agent
        names: list[str] = self.endpoint._driver.call_and_wait(
            lambda: sorted(agent._remote_dlists), 5.0)
        return names

    def rescrub(self, dst: list[int]) -> None:
        """Paint blocks the engine got back with the canary again (as if reused)."""
        self.scrub(np.asarray(dst, dtype=np.int64))

    def quarantine_over(self, dst: list[int]) -> None:
        """The engine takes back blocks it had quarantined: count what landed in them
        meanwhile, and paint them again (bytes found when they are handed out next landed
        after the quarantine: ``late_bytes``)."""
        assert self.cache is not None
        ids = np.asarray(dst, dtype=np.int64)
        for buf in self.cache.buffers:
            self.quarantine_bytes += int(np.count_nonzero(buf[ids] != CANARY))
        self.scrub(ids)
        self.was_quarantined.update(ids.tolist())

    def canary_intact(self, dst: list[int]) -> bool:
        """True while blocks ``dst`` hold nothing but the canary (nothing landed there)."""
        assert self.cache is not None
        ids = np.asarray(dst, dtype=np.int64)
        return all(bool((buf[ids] == CANARY).all()) for buf in self.cache.buffers)

    def stats(self) -> dict[str, int]:
        return {**self.endpoint.stats(), "pending": self.endpoint.pending,
                "late_bytes": self.late_bytes, "quarantine_bytes": self.quarantine_bytes,
                "late_bytes_after_quarantine": self.late_bytes_after_quarantine}

    def info(self) -> dict[str, Any]:
        rss_kb = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss_kb = int(line.split()[1])
        return {"pid": os.getpid(), "rss_kb": rss_kb, "fds": len(os.listdir("/proc/self/fd")),
                "tasks": len(os.listdir("/proc/self/task")),
                "threads": [t.name for t in threading.enumerate()]}

    def close(self, timeout: float = 10.0) -> dict[str, Any]:
        if self.endpoint is not None:
            self.endpoint.close(timeout=timeout)
            self.endpoint = None
        threads = [t.name for t in threading.enumerate() if t.name.startswith("kvpush-")]
        return {"live": LIVE.snapshot(), "threads": threads}


def main() -> None:
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from C libraries go to the log, never into the protocol
    sys.stdout = sys.stderr
    # kvpush's INFO lines (connections, peers lost, requests failed) in the node's log, which
    # a failing test shows (tests/conftest.py)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    node = NodeState()

    def answer(seq: int, ok: bool, value: Any = None, error: str = "") -> None:
        proto.write(json.dumps({"seq": seq, "ok": ok, "value": value, "error": error}) + "\n")

    answer(0, True, "ready")
    for line in sys.stdin:
        msg = json.loads(line)
        seq, cmd, args = msg["seq"], msg["cmd"], msg["args"]
        if cmd == "exit":
            answer(seq, True, node.close())
            proto.flush()
            os._exit(0)  # skip interpreter teardown: nothing is left to flush
        try:
            fn = getattr(node, cmd) if not cmd.startswith("_") else None
            if fn is None or not callable(fn):
                raise ValueError(f"unknown command {cmd!r}")
            value = fn(**args)
        except Exception as exc:
            answer(seq, False, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        else:
            answer(seq, True, value)
    node.close()  # stdin closed: the parent is gone


if __name__ == "__main__":
    main()
