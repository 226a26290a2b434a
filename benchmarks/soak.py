"""Soak: many requests across two network namespaces while faults are injected at random.

``python -m benchmarks.soak --requests 100000`` (or ``run(requests=...)`` from Python).

Two "hosts" joined by a veth pair (``tests/support/netns.py``; UCX over TCP only): producers
``p0`` and ``p1`` in one namespace, consumers ``c0`` and ``c1`` in the other, each a child
process (``tests/support/netns_node.py``). ``p0`` and ``c0`` are never killed (their RSS and open
file descriptors are measured after warm-up and at the end); ``p1`` and ``c1`` are killed
and restarted under the same name. ``c1`` runs with ``verify=True`` (both producers put
checksums in tickets), so about half the requests are verified by kvpush as well.

Each request picks a consumer, a producer, push or pull, block counts, the order of
registration and prefill, and with some probability a fault of its own: an abort from
either side after a random delay, a deadline too short to make, a registration that never
comes, a prefill that never comes, a pull ticket never used. Every so often a global fault
hits: ``p1`` or ``c1`` killed and restarted, the link cut for a while, or a consumer
frozen (SIGSTOP/SIGCONT).

Every READY request's destination bytes are compared with the producer's source bytes
(``corrupted_bytes``); destination blocks are painted with a canary once their request is
reported and checked when handed out again (``late_landing_bytes``: bytes that landed
after the consumer said the blocks were free; blocks of a result that says
``blocks_safe=False`` are kept out of the pool for ``QUARANTINE_S`` first, then checked the
same way). A request is *lost* if a surviving side
never reports it by its deadline; a block is *leaked* if it never comes back. Writes
``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import os
import random
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The namespace harness lives with the tests (it is test infrastructure); the soak reuses it.
from tests.support.netns import Ledger, Link, Node, NodeError, netns_unavailable  # noqa: E402

__all__ = ["run"]

CACHE = dict(num_blocks=1024, num_layers=2)   # 1 KiB per block id
PEER_TIMEOUT = 1.5
PRODUCER = dict(lease_s=2.0, peer_timeout_s=PEER_TIMEOUT, transfer_timeout_s=4.0,
                max_wait_s=30.0, tombstone_s=30.0, verify=True)
CONSUMER = dict(heartbeat_s=0.15, peer_timeout_s=PEER_TIMEOUT, abort_grace_s=1.0,
                request_timeout_s=6.0, lease_margin_s=0.05, connect_timeout_s=5.0)
REQUEST_TIMEOUT = 6.0
#: a side that has not reported a request this long after the driver's last action on it
#: (handing it to both sides, a delayed prefill or abort), or after its consumer's last
#: thaw, has lost it; the driver is one thread, and a call that blocks delays its actions
DEADLINE = REQUEST_TIMEOUT + PRODUCER["lease_s"] + PRODUCER["transfer_timeout_s"] + 10.0
#: destination blocks of a result with blocks_safe=False stay out of the pool this long
#: (kvpush cannot say when such bytes stop coming; handing the blocks out again afterwards
#: checks them for late bytes like any other)
QUARANTINE_S = 20.0
#: after a global fault ends, requests begun this much later are still "hit by it"
RECOVERY = PEER_TIMEOUT + CONSUMER["abort_grace_s"] + 2.0
REQUEST_FAULTS = {  # per-request fault: probability
    "consumer_abort": 0.03, "producer_abort": 0.03, "short_deadline": 0.02,
    "no_registration": 0.01, "no_prefill": 0.01, "ticket_unused": 0.01,
}
GLOBAL_FAULTS = ["kill_producer", "kill_consumer", "link_cut", "freeze_consumer"]
#: node calls slower than this go into the report's timeline (the driver is one thread: a
#: slow call delays fault ends, polls and retirement alike)
SLOW_CALL_S = 1.0
#: a request that failed with no fault seen is called unexpected only this much later
#: (health checks, which notice data-plane restarts, run every 0.5 s)
UNEXPECTED_WAIT = 1.5
TIMELINE_MAX = 2000


@dataclass
class Request:
    rid: str
    mode: str
    producer: str
    consumer: str
    src: list[int]
    dst: list[int]
    fault: str
    began: float                      # the driver's last action on it (see DEADLINE)
    p_inc: int
    c_inc: int
    hit: bool = False                 # a global fault overlapped its life
    waiting: int = 0                  # delayed actions (prefill, abort) not yet run
    consumer_owes: bool = False       # the consumer accepted it: it owes one result
    producer_owes: bool = False       # the producer holds its blocks: it owes one release
    result: dict[str, Any] | None = None
    release: str | None = None
    consumer_died: bool = False
    producer_died: bool = False
    failed_at: float = 0.0            # when it settled not READY with no fault seen (yet)

    def settled(self) -> bool:
        if self.waiting:
            return False
        c_ok = not self.consumer_owes or self.result is not None or self.consumer_died
        p_ok = not self.producer_owes or self.release is not None or self.producer_died
        return c_ok and p_ok


@dataclass
class Soak:
    link: Link
    rng: random.Random
    window: int
    progress: bool
    error_mode: str = "none"      # TransportConfig.ucx_error_mode of every node
    data_plane: str = "inprocess"  # TransportConfig.data_plane of every node
    nodes: dict[str, Node] = field(default_factory=dict)
    incarnation: Counter[str] = field(default_factory=Counter)
    seeds: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    src_free: dict[str, list[int]] = field(default_factory=dict)
    dst_free: dict[str, list[int]] = field(default_factory=dict)
    # destination blocks of results with blocks_safe=False, kept out of the pool for
    # QUARANTINE_S: (until, consumer, its incarnation, blocks)
    quarantine: list[tuple[float, str, int, list[int]]] = field(default_factory=list)
    frozen_until: dict[str, float] = field(default_factory=dict)
    thawed: dict[str, float] = field(default_factory=dict)   # when each consumer last ran on
    connected: set[tuple[str, str]] = field(default_factory=set)
    active: dict[str, Request] = field(default_factory=dict)
    timers: list[tuple[float, int, str, str]] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)
    counts: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    by_fault: dict[str, Counter[str]] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    hit_until: float = 0.0
    link_down_until: float = 0.0
    late_seen: Counter[str] = field(default_factory=Counter)
    quarantine_seen: Counter[str] = field(default_factory=Counter)
    after_quarantine_seen: Counter[str] = field(default_factory=Counter)
    mismatches_seen: Counter[str] = field(default_factory=Counter)
    restarts_seen: Counter[str] = field(default_factory=Counter)  # data-plane restarts
    seq: itertools.count[int] = field(default_factory=itertools.count)
    crashes: list[dict[str, Any]] = field(default_factory=list)
    t_start: float = field(default_factory=time.monotonic)
    # what happened when (seconds since start): faults, their ends, crashes, node calls
    # slower than SLOW_CALL_S, lost requests; the first TIMELINE_MAX events
    timeline: list[tuple[float, str]] = field(default_factory=list)

    def event(self, what: str) -> None:
        if len(self.timeline) < TIMELINE_MAX:
            self.timeline.append((round(time.monotonic() - self.t_start, 2), what))

    # -- nodes -----------------------------------------------------------------------------
    def start(self, label: str) -> None:
        role = "producer" if label.startswith("p") else "consumer"
        self.incarnation[label] += 1
        ns, dev = (self.link.a_ns, self.link.a_dev) if role == "producer" else \
            (self.link.b_ns, self.link.b_dev)
        node = Node(label, ns, dev)
        transport = {"ucx_error_mode": self.error_mode, "data_plane": self.data_plane}
        # a contained data plane maps the KV cache: it must be shared memory
        cache = dict(CACHE, shared=self.data_plane == "child")
        try:
            if role == "producer":
                self.seeds[label] = 1000 * (1 + int(label[1:])) + self.incarnation[label]
                config = dict(PRODUCER, host=self.link.a_ip, port=self.ports.get(label, 0),
                              transport=transport, name=f"soak-{label}")
                node.start(role, cache, config, seed=self.seeds[label], scrub_on_release=True)
                self.ports[label] = int(node.address.rsplit(":", 1)[1])
                self.src_free[label] = list(range(CACHE["num_blocks"]))
            else:
                config = dict(CONSUMER, name=f"soak-{label}", verify=label == "c1",
                              transport=transport)
                node.start(role, cache, config, scrub_on_result=True)
                self.dst_free[label] = list(range(CACHE["num_blocks"]))
        except BaseException:
            node.close()
            raise
        self.nodes[label] = node

    def usable(self, label: str) -> bool:
        """Alive and not frozen (a frozen node cannot answer its pipe)."""
        node = self.nodes.get(label)
        return node is not None and not node.stopped and node.alive()

    def reconnect(self) -> None:
        """What a router does: connect every consumer to every producer it lacks."""
        if time.monotonic() < self.link_down_until:
            return
        for c in ("c0", "c1"):
            if not self.usable(c):
                continue
            names = set(self._call(c, "producers") or [])
            if not self.usable(c):
                continue
            for p in ("p0", "p1"):
                if not self.usable(p):
                    continue
                if self.nodes[p].name in names:
                    self.connected.add((c, p))
                    continue
                self.connected.discard((c, p))
                try:
                    self.nodes[c].call("connect", address=self.nodes[p].address, timeout=3.0)
                    self.connected.add((c, p))
                except NodeError:
                    self.counts["connect_failures"] += 1
                    if not self.nodes[c].alive():
                        self.crashed(c)
                        return

    # -- requests --------------------------------------------------------------------------
    def submit(self, n: int, rid_base: int) -> int:
        """Begin up to ``n`` requests; returns how many began."""
        now = time.monotonic()
        prefills: dict[str, list[list[Any]]] = {"p0": [], "p1": []}
        expects: dict[str, list[list[Any]]] = {"c0": [], "c1": []}
        pulls: list[Request] = []
        batch: list[Request] = []
        began = 0
        pairs = sorted(pair for pair in self.connected
                       if self.usable(pair[0]) and self.usable(pair[1]))
        for i in range(n):
            if not pairs:
                break
            c, p = self.rng.choice(pairs)
            k = self.rng.randint(1, 8)
            if len(self.src_free[p]) < k or len(self.dst_free[c]) < k:
                break
            fault = "none"
            roll = self.rng.random()
            for name, prob in REQUEST_FAULTS.items():
                roll -= prob
                if roll < 0:
                    fault = name
                    break
            mode = self.rng.choice(["push", "pull"])
            if fault in ("no_prefill", "no_registration"):
                mode = "push"
            if fault == "ticket_unused":
                mode = "pull"
            src = self._take(self.src_free[p], k)
            dst = self._take(self.dst_free[c], k)
            req = Request(f"s{rid_base + i}", mode, p, c, src, dst, fault, now,
                          self.incarnation[p], self.incarnation[c], hit=now < self.hit_until)
            self.active[req.rid] = req
            batch.append(req)
            began += 1
            timeout = REQUEST_TIMEOUT
            if fault == "short_deadline":
                timeout = self.rng.uniform(0.005, 0.05)
            elif fault == "no_prefill":
                timeout = self.rng.uniform(0.1, 0.5)
            if fault in ("no_registration", "ticket_unused"):
                self.dst_free[c].extend(dst)  # the consumer never hears of it
            if mode == "push":
                if fault != "no_registration":
                    expects[c].append([req.rid, dst, self.nodes[p].name, timeout,
                                       self.seeds[p], src])
                    req.consumer_owes = True
                if fault == "no_prefill":
                    self.src_free[p].extend(src)  # never handed to the producer
                elif self.rng.random() < 0.5:
                    prefills[p].append([req.rid, src, "push"])
                    req.producer_owes = True
                else:  # registration first, prefill a little later
                    self._later(self.rng.uniform(0.0, 0.02), "prefill", req.rid)
            else:
                prefills[p].append([req.rid, src, "pull"])
                req.producer_owes = True
                if fault != "ticket_unused":
                    pulls.append(req)
            if fault == "consumer_abort":
                self._later(self.rng.uniform(0.0, 0.03), "consumer_abort", req.rid)
            elif fault == "producer_abort":
                self._later(self.rng.uniform(0.0, 0.03), "producer_abort", req.rid)
        tickets: dict[str, str] = {}
        for p, items in prefills.items():
            if items:
                for item, answer in zip(items, self._call(p, "prefill", items=items) or [],
                                        strict=False):
                    self._prefilled(item[0], answer, tickets)
        self._submit("expect", expects)
        by_consumer: dict[str, list[list[Any]]] = {"c0": [], "c1": []}
        for req in pulls:
            if req.rid in tickets:
                timeout = self.rng.uniform(0.005, 0.05) if req.fault == "short_deadline" \
                    else REQUEST_TIMEOUT
                by_consumer[req.consumer].append([req.rid, tickets[req.rid], req.dst, timeout,
                                                  self.seeds[req.producer]])
                req.consumer_owes = True
        self._submit("pull", by_consumer)
        # The clock of these requests starts now that both sides have them: a call above
        # may have blocked for seconds (a pull connects to its ticket's producer first).
        now = time.monotonic()
        for req in batch:
            req.began = now
        return began

    def _submit(self, cmd: str, by_consumer: dict[str, list[list[Any]]]) -> None:
        """Hand each consumer its batch of ``cmd`` items; a request it refuses is noted."""
        for c, items in by_consumer.items():
            if items:
                for item, error in zip(items, self._call(c, cmd, items=items) or [],
                                       strict=False):
                    if error is not None:
                        self._refused(item[0], error)

    def _take(self, pool: list[int], k: int) -> list[int]:
        picked = self.rng.sample(range(len(pool)), k)
        out = [pool[i] for i in picked]
        for i in sorted(picked, reverse=True):
            pool[i] = pool[-1]
            pool.pop()
        return out

    def _later(self, delay: float, action: str, rid: str) -> None:
        self.active[rid].waiting += 1
        heapq.heappush(self.timers, (time.monotonic() + delay, next(self.seq), action, rid))

    def _prefilled(self, rid: str, answer: Any, tickets: dict[str, str]) -> None:
        if isinstance(answer, dict):  # refused by the producer's API: nothing is held
            req = self.active[rid]
            req.producer_owes = False
            self.src_free[req.producer].extend(req.src)
            self._note("prefill_refused", f"{rid}: {answer['error']}")
        elif answer is not None:
            tickets[rid] = answer

    def _refused(self, rid: str, error: str) -> None:
        req = self.active[rid]
        req.consumer_owes = False
        if req.c_inc == self.incarnation[req.consumer]:
            self.dst_free[req.consumer].extend(req.dst)
        req.result = {"state": "refused", "error": error.split(":", 1)[0], "corrupted": 0}

    def _call(self, label: str, cmd: str, **args: Any) -> Any:
        """A call into a node; None if it is frozen or died (a death we did not cause is
        recorded as a crash, and the node restarted)."""
        node = self.nodes.get(label)
        if node is None or node.stopped:
            return None
        if not node.alive():
            self.crashed(label)
            return None
        began = time.monotonic()
        try:
            value = self.nodes[label].call(cmd, **args)
        except NodeError:
            self.event(f"{label} {cmd}: no answer after {time.monotonic() - began:.1f} s")
            node = self.nodes[label]
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=2.0)  # its pipe closed: it may be exiting
            if not node.alive():
                self.crashed(label)
                return None
            try:
                info = node.call("info", timeout=10.0)
            except NodeError:
                self.crashed(label, "stopped answering")
                return None
            if f"{node.name}-loop" in info["threads"]:
                raise  # a real error of the harness: let it show
            self.crashed(label, "kvpush loop thread crashed")
            return None
        took = time.monotonic() - began
        if took > SLOW_CALL_S:
            self.event(f"{label} {cmd} took {took:.1f} s")
        return value

    def crashed(self, label: str, what: str = "process died") -> None:
        """A node died on its own (or its kvpush loop thread did): record why, fail its
        side of its requests, restart it."""
        node = self.nodes[label]
        if node.alive():
            node.kill()
        self.event(f"{label} crashed: {what}")
        # the tail holds UCX's native backtrace and Python's stacks (see netns.node_env)
        log = node.log_tail(60)
        self.crashes.append({"node": label, "what": what,
                             "incarnation": self.incarnation[label],
                             "after_s": round(time.monotonic() - self.t_start, 1),
                             "exit": node.proc.returncode, "log": log})
        first = next((line for line in log.splitlines() if "Fatal" in line), log[-300:])
        print(f"[soak] {label} CRASHED ({what}, rc {node.proc.returncode}): {first}",
              flush=True)
        self.died(label)
        node.close()
        self.start(label)
        self.mark_hit(time.monotonic() + RECOVERY)

    def health(self) -> None:
        """A node whose kvpush loop thread died still answers its pipe: look for that. A
        data-plane restart (data_plane="child") is a fault too: the requests about then
        are hit by it."""
        for label in ("p0", "p1", "c0", "c1"):
            info = self._call(label, "info")
            if info is not None and f"{self.nodes[label].name}-loop" not in info["threads"]:
                self.crashed(label, "kvpush loop thread crashed")
            if self.data_plane == "child":
                stats = self._call(label, "stats")
                key = f"{label}#{self.incarnation[label]}"
                if stats and stats["data_plane_restarts"] > self.restarts_seen[key]:
                    self.restarts_seen[key] = stats["data_plane_restarts"]
                    # why: the dead child's last words (UCX's fatal) are in the node's log
                    tail = self.nodes[label].log_tail(80).splitlines()
                    why = next((ln for ln in reversed(tail) if "Fatal" in ln),
                               next((ln for ln in reversed(tail) if "data plane lost" in ln),
                                    ""))
                    self.event(f"{label} data plane restarted: {why.strip()[-200:]}")
                    self.mark_hit(time.monotonic() + RECOVERY)

    def died(self, label: str) -> None:
        for req in self.active.values():
            if label == req.producer and req.p_inc == self.incarnation[label]:
                req.producer_died = True
            if label == req.consumer and req.c_inc == self.incarnation[label]:
                req.consumer_died = True
        self.connected = {pair for pair in self.connected if label not in pair}

    def run_timers(self) -> None:
        now = time.monotonic()
        due: dict[tuple[str, str], list[Any]] = {}
        while self.timers and self.timers[0][0] <= now:
            _, _, action, rid = heapq.heappop(self.timers)
            req = self.active.get(rid)
            if req is None:
                continue
            req.waiting -= 1
            req.began = max(req.began, now)  # its clock runs from the driver's last action
            if action == "prefill":
                if req.p_inc == self.incarnation[req.producer] and self.usable(req.producer):
                    req.producer_owes = True
                    due.setdefault((req.producer, "prefill"), []).append(
                        [rid, req.src, "push"])
                elif req.p_inc == self.incarnation[req.producer]:
                    self._later(0.05, "prefill", rid)  # frozen: try again soon
            elif action == "consumer_abort":
                due.setdefault((req.consumer, "abort"), []).append(rid)
            else:
                due.setdefault((req.producer, "abort"), []).append(rid)
        for (label, cmd), items in due.items():
            if cmd == "prefill":
                for item, answer in zip(items, self._call(label, "prefill", items=items) or [],
                                        strict=False):
                    self._prefilled(item[0], answer, {})
            else:
                self._call(label, "abort", rids=items)

    def poll(self) -> None:
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            _, label, inc, blocks = self.quarantine[0]
            if inc == self.incarnation[label] and self.nodes[label].stopped:
                break  # frozen: its blocks come back once it runs again
            self.quarantine.pop(0)
            if inc == self.incarnation[label]:  # checked for late bytes when reused
                self._call(label, "quarantine_over", dst=blocks)
                self.dst_free[label].extend(blocks)
        for label in ("c0", "c1"):
            got = self._call(label, "results")
            for res in got or []:
                # the ledger keeps only the state: 100k full results would be the driver's
                # own memory growth
                self.ledger.results[res["rid"]].append({"state": res["state"]})
                req = self.active.get(res["rid"])
                if len(self.ledger.results[res["rid"]]) > 1:
                    self.counts["double_reports"] += 1
                    continue
                if req is None:  # already counted as lost
                    self.counts["results_after_deadline"] += 1
                    continue
                req.result = res
                self.counts["corrupted_bytes"] += res["corrupted"]
                if not res["safe"]:
                    self.counts["results_unsafe"] += 1
                if req.c_inc == self.incarnation[label]:
                    if res["safe"]:
                        self.dst_free[label].extend(req.dst)
                    else:  # bytes may still land there: keep them out for a while
                        self.counts["blocks_quarantined"] += len(req.dst)
                        self.quarantine.append((time.monotonic() + QUARANTINE_S, label,
                                                req.c_inc, list(req.dst)))
        for label in ("p0", "p1"):
            got = self._call(label, "released")
            for rid, reason, _nblocks, _detail in got or []:
                self.ledger.releases[rid].append(reason)
                req = self.active.get(rid)
                if len(self.ledger.releases[rid]) > 1:
                    self.counts["double_releases"] += 1
                    continue
                if req is None:  # already counted as lost
                    self.counts["releases_after_deadline"] += 1
                    continue
                req.release = reason
                if req.p_inc == self.incarnation[label]:
                    self.src_free[label].extend(req.src)

    def retire(self, final: bool = False) -> None:
        """Account for requests both sides have reported (or that ran past the deadline)."""
        now = time.monotonic()
        for rid, req in list(self.active.items()):
            if not req.settled():
                # a frozen consumer reports nothing: its requests' clocks restart at the thaw
                if not final and (req.consumer in self.frozen_until or now - max(
                        req.began, self.thawed.get(req.consumer, 0.0)) < DEADLINE):
                    continue
                missing = []
                if req.consumer_owes and req.result is None and not req.consumer_died:
                    missing.append("consumer result")
                if req.producer_owes and req.release is None and not req.producer_died:
                    missing.append("producer release")
                self.counts["lost"] += 1
                self.event(f"lost {rid}, began at {req.began - self.t_start:.2f} s")
                self._note("lost", f"{rid} ({req.mode}, {req.fault}, {req.producer}->"
                                   f"{req.consumer}): no {' or '.join(missing)}")
                del self.active[rid]
                continue
            del self.active[rid]
            state = req.result["state"] if req.result else "none"
            if req.consumer_died or req.producer_died:
                req.hit = True
            if state == "ready" and req.result and req.result["corrupted"] == 0:
                outcome = "completed"
            elif state == "ready":
                outcome = "corrupted"
                self._note("corrupted", f"{rid} ({req.mode}, {req.fault}, hit={req.hit}, "
                                        f"{req.producer}->{req.consumer}): "
                                        f"{req.result and req.result['corrupted']} bytes")
            elif req.fault != "none" or req.hit:
                outcome = "failed_by_design"
            elif not final and (not req.failed_at or now - req.failed_at < UNEXPECTED_WAIT):
                # a fault noticed late (a data-plane restart, seen at the next health
                # check) may explain it: wait that long before calling it unexpected
                req.failed_at = req.failed_at or now
                self.active[rid] = req
                continue
            else:
                outcome = "failed_unexpected"
                self._note("unexpected", f"{rid} ({req.mode}, {req.producer}->{req.consumer}):"
                                         f" {state} {req.result and req.result.get('error')}"
                                         f" release={req.release}")
            self.counts[outcome] += 1
            self.counts[f"mode_{req.mode}"] += 1
            if req.consumer == "c1":
                self.counts["verified"] += 1
            fault = req.fault if req.fault != "none" or not req.hit else "global"
            self.by_fault.setdefault(f"{req.mode}/{fault}", Counter())[
                f"{state}/{req.release}"] += 1

    def _note(self, kind: str, text: str) -> None:
        self.counts[f"note_{kind}"] += 1
        bucket = self.examples.setdefault(kind, [])
        if len(bucket) < 10:
            bucket.append(text)

    # -- global faults ---------------------------------------------------------------------
    def mark_hit(self, until: float) -> None:
        for req in self.active.values():
            req.hit = True
        self.hit_until = max(self.hit_until, until)

    def inject(self, kind: str) -> None:
        self.faults[kind] += 1
        now = time.monotonic()
        if kind in ("kill_producer", "kill_consumer"):
            label = "p1" if kind == "kill_producer" else "c1"
            self.event(f"{kind}: {label}")
            self.sample_counters(label)
            self.frozen_until.pop(label, None)  # a frozen process dies too
            self.nodes[label].kill()
            self.nodes[label].close()  # reaped already; this removes its log
            self.died(label)
            self.mark_hit(now + RECOVERY)
            self.start(label)  # same name (and, for a producer, the same port)
            if label == "p1":  # consumers drop the old incarnation before reconnecting
                deadline = time.monotonic() + PEER_TIMEOUT + 2.0
                while time.monotonic() < deadline and any(
                        self.nodes[label].name in (self._call(c, "producers") or [])
                        for c in ("c0", "c1")):
                    self.housekeeping()
                    time.sleep(0.05)
            self.mark_hit(time.monotonic() + RECOVERY)
            self.reconnect()
        elif kind == "link_cut":
            down = self.rng.uniform(0.3, 3.0)
            self.event(f"link_cut for {down:.1f} s")
            self.link.cut()
            self.link_down_until = now + down
            self.mark_hit(now + down + RECOVERY)
        else:
            label = self.rng.choice(["c0", "c1"])
            if self.usable(label):
                pause = self.rng.uniform(0.2, 2.5)
                self.event(f"freeze_consumer: {label} for {pause:.1f} s")
                self.nodes[label].stop()
                self.frozen_until[label] = now + pause
                self.mark_hit(now + pause + RECOVERY)

    def housekeeping(self) -> None:
        now = time.monotonic()
        if self.link_down_until and now >= self.link_down_until:
            self.event(f"link restored ({now - self.link_down_until:.1f} s late)")
            self.link.restore()
            self.link_down_until = 0.0
        for label, until in list(self.frozen_until.items()):
            if now >= until:
                self.event(f"{label} thawed ({now - until:.1f} s late)")
                self.nodes[label].cont()
                self.thawed[label] = now
                del self.frozen_until[label]

    def sample_counters(self, label: str) -> None:
        """Remember a node's late bytes and checksum mismatches (before a kill)."""
        stats = self._call(label, "stats")
        if stats:
            key = f"{label}#{self.incarnation[label]}"
            self.late_seen[key] = stats["late_bytes"]
            self.quarantine_seen[key] = stats["quarantine_bytes"]
            self.after_quarantine_seen[key] = stats["late_bytes_after_quarantine"]
            self.mismatches_seen[key] = stats["checksum_mismatches"]
            self.restarts_seen[key] = stats.get("data_plane_restarts", 0)

    def info(self, label: str) -> dict[str, Any]:
        got: dict[str, Any] | None = self._call(label, "info")
        if got is None:  # it crashed and was restarted just now
            got = self.nodes[label].call("info")
        assert got is not None
        return got

    def close(self) -> dict[str, Any]:
        finals = {}
        for label, node in self.nodes.items():
            if node.stopped:
                node.cont()
            rc = node.close()
            finals[label] = {"rc": rc, **(node.final or {})}
        return finals


def _self_usage() -> dict[str, int]:
    rss_kb = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return {"rss_kb": rss_kb, "fds": len(os.listdir("/proc/self/fd"))}


def run(requests: int, *, seed: int = 1, window: int = 48, fault_every: int = 1500,
        warmup: int | None = None, progress: bool = True, out: str | None = None,
        all_faults: bool = False, max_seconds: float | None = None,
        error_mode: str = "none", faults: list[str] | None = None,
        data_plane: str = "inprocess") -> dict[str, Any]:
    """Run the soak for ``requests`` requests; returns (and writes to ``out``) the figures.

    ``fault_every``: mean number of requests between global faults. ``all_faults``: inject
    each kind of global fault at least once (in turn, first), for short runs.
    ``max_seconds``: stop beginning requests after this long (the report's ``requests``
    then says how many were run). ``error_mode``: UCX error-handling mode of every node.
    ``faults``: the kinds of global fault to draw from (default: all of GLOBAL_FAULTS);
    ``["link_cut", "kill_consumer"]`` reproduces UCX's "Endpoint timeout" abort
    (``docs/RELIABILITY.md``) in most short runs, where its trigger is not avoided.
    ``data_plane``: ``TransportConfig.data_plane`` of every node (``"child"``: each node's
    NIXL agent in a data-plane child, its KV cache in shared memory; the report's
    ``data_plane_restarts`` counts the children lost, ``crashes`` the nodes).
    """
    kinds = list(GLOBAL_FAULTS if faults is None else faults)
    if not kinds or set(kinds) - set(GLOBAL_FAULTS):
        raise ValueError(f"faults must be a non-empty subset of {GLOBAL_FAULTS}, got {faults}")
    reason = netns_unavailable()
    if reason is not None:
        raise RuntimeError(f"the soak needs network namespaces: {reason}")
    rng = random.Random(seed)
    requests_asked = requests
    warmup = min(2000, requests // 10) if warmup is None else warmup
    t_start = time.monotonic()
    link = Link()
    soak = Soak(link, rng, window, progress, error_mode, data_plane)
    report: dict[str, Any] = {}
    try:
        for label in ("p0", "p1", "c0", "c1"):
            soak.start(label)
        soak.reconnect()
        submitted = 0
        next_fault = rng.randint(fault_every // 2, fault_every * 3 // 2)
        pending_kinds = list(kinds) if all_faults else []
        last_print = last_reconnect = time.monotonic()
        baseline: dict[str, Any] | None = None
        t_warm = time.monotonic()
        while submitted < requests or soak.active:
            soak.housekeeping()
            now = time.monotonic()
            if max_seconds is not None and now - t_start > max_seconds and \
                    submitted < requests:
                print(f"[soak] time budget of {max_seconds} s spent: stopping at {submitted} "
                      "requests", flush=True)
                requests = submitted
            if submitted < requests and submitted >= next_fault and baseline is not None:
                kind = pending_kinds.pop(0) if pending_kinds else rng.choice(kinds)
                soak.inject(kind)
                next_fault = submitted + rng.randint(fault_every // 2, fault_every * 3 // 2)
            if now - last_reconnect > 0.5:
                soak.health()
                soak.reconnect()
                last_reconnect = now
            if submitted < requests:
                room = min(window - len(soak.active), requests - submitted)
                if room > 0:
                    submitted += soak.submit(room, submitted)
            soak.run_timers()
            soak.poll()
            soak.retire(final=False)
            done = sum(soak.counts[k] for k in ("completed", "failed_by_design",
                                                "failed_unexpected", "corrupted", "lost"))
            if baseline is None and done >= warmup:
                baseline = {label: {**soak.info(label), "inc": soak.incarnation[label]}
                            for label in ("p0", "c0")}
                baseline["driver"] = _self_usage()
                t_warm = time.monotonic()
            if progress and time.monotonic() - last_print > 5.0:
                last_print = time.monotonic()
                rate = done / (last_print - t_start)
                print(f"[soak] {done}/{requests} done ({rate:.0f}/s): "
                      f"completed {soak.counts['completed']}, by design "
                      f"{soak.counts['failed_by_design']}, unexpected "
                      f"{soak.counts['failed_unexpected']}, lost {soak.counts['lost']}, "
                      f"corrupted {soak.counts['corrupted_bytes']} B, faults "
                      f"{dict(soak.faults)}", flush=True)
            if not soak.active and submitted >= requests:
                break
            time.sleep(0.001)
        soak.housekeeping()
        if soak.link_down_until:
            link.restore()
        soak.retire(final=True)
        # Every surviving side must be idle now: nothing held, nothing pending.
        time.sleep(0.5)
        for label in ("p0", "p1", "c0", "c1"):
            if soak.frozen_until.get(label):
                soak.nodes[label].cont()
                soak.frozen_until.pop(label)
        pending = {label: (soak._call(label, "stats") or {}).get("pending")
                   for label in ("p0", "p1", "c0", "c1")}
        for label in ("p0", "p1", "c0", "c1"):
            soak.sample_counters(label)
        end = {label: {**soak.info(label), "inc": soak.incarnation[label]}
               for label in ("p0", "c0")}
        end["driver"] = _self_usage()
        if baseline is None:
            baseline = end
        free_src = {p: len(soak.src_free[p]) for p in ("p0", "p1")}
        for _, label, inc, blocks in soak.quarantine:
            if inc == soak.incarnation[label]:
                soak.dst_free[label].extend(blocks)
        free_dst = {c: len(soak.dst_free[c]) for c in ("c0", "c1")}
        finals = soak.close()
        elapsed = time.monotonic() - t_start
        c = soak.counts
        rss = {label: [baseline[label]["rss_kb"], end[label]["rss_kb"]] for label in ("p0", "c0")}
        report = {
            "requests": requests, "requests_asked": requests_asked, "seed": seed,
            "window": window, "seconds": round(elapsed, 1),
            "requests_per_s": round(requests / elapsed, 1),
            "completed": c["completed"], "failed_by_design": c["failed_by_design"],
            "failed_unexpected": c["failed_unexpected"], "lost": c["lost"],
            "ready_but_corrupted": c["corrupted"],
            "corrupted_bytes": c["corrupted_bytes"],
            "late_landing_bytes": sum(soak.late_seen.values()),
            "bytes_landed_in_quarantine": sum(soak.quarantine_seen.values()),
            "bytes_landed_after_quarantine": sum(soak.after_quarantine_seen.values()),
            "checksum_mismatches": sum(soak.mismatches_seen.values()),
            "double_reports": c["double_reports"], "double_releases": c["double_releases"],
            "results_unsafe": c["results_unsafe"],
            "blocks_quarantined": c["blocks_quarantined"],
            # blocks never given back (pools of killed incarnations start afresh)
            "blocks_leaked": sum(CACHE["num_blocks"] - n
                                 for n in (*free_src.values(), *free_dst.values())),
            "results_after_deadline": c["results_after_deadline"],
            "releases_after_deadline": c["releases_after_deadline"],
            "pending_at_end": pending,
            "push": c["mode_push"], "pull": c["mode_pull"], "verified_share": round(
                c["verified"] / max(1, requests), 3),
            "global_faults": dict(soak.faults),
            "outcomes_by_fault": {k: dict(v) for k, v in sorted(soak.by_fault.items())},
            "warmup_requests": warmup, "warmup_s": round(t_warm - t_start, 1),
            "rss_kb": rss,
            # None where the process crashed and restarted after warm-up (see crashes)
            "rss_growth_pct": {label: round(100.0 * (b - a) / a, 2)
                               if baseline[label].get("inc") == end[label].get("inc") else None
                               for label, (a, b) in rss.items()},
            "fds": {label: [baseline[label]["fds"], end[label]["fds"]]
                    for label in ("p0", "c0", "driver")},
            "driver_rss_kb": [baseline["driver"]["rss_kb"], end["driver"]["rss_kb"]],
            "threads_at_end": {label: end[label]["threads"] for label in ("p0", "c0")},
            "nodes_at_close": finals,
            "connect_failures": c["connect_failures"],
            # nodes that died without being killed (e.g. a fatal UCX error), with log tails;
            # a crashed p0/c0 restarts, and its RSS/fd figures then cover the new process
            "crashes": soak.crashes,
            # data-plane children lost and restarted (data_plane="child"), per node, over
            # its incarnations (a killed node's count as sampled just before the kill)
            "data_plane_restarts": {
                label: sum(n for k, n in soak.restarts_seen.items()
                           if k.split("#")[0] == label)
                for label in ("p0", "p1", "c0", "c1")},
            "examples": soak.examples,
            "timeline": soak.timeline,
            "config": {"producer": PRODUCER, "consumer": CONSUMER, "cache": CACHE,
                       "global_fault_kinds": kinds,
                       "ucx_error_mode": error_mode, "data_plane": data_plane,
                       "request_faults": REQUEST_FAULTS, "fault_every": fault_every},
        }
    finally:
        for node in soak.nodes.values():
            if node.alive():
                node.close()
        link.close()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--fault-every", type=int, default=1500)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop beginning requests after this long")
    ap.add_argument("--ucx-error-mode", choices=["none", "peer"], default="none")
    ap.add_argument("--data-plane", choices=["inprocess", "child"], default="inprocess",
                    help="TransportConfig.data_plane of every node")
    ap.add_argument("--faults", default=",".join(GLOBAL_FAULTS),
                    help="comma-separated kinds of global fault to draw from")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    report = run(args.requests, seed=args.seed, window=args.window,
                 fault_every=args.fault_every, progress=not args.quiet, out=args.out,
                 all_faults=True, max_seconds=args.max_seconds,
                 error_mode=args.ucx_error_mode, faults=args.faults.split(","),
                 data_plane=args.data_plane)
    keys = ["requests", "seconds", "completed", "failed_by_design", "failed_unexpected",
            "lost", "corrupted_bytes", "late_landing_bytes", "bytes_landed_in_quarantine",
            "bytes_landed_after_quarantine", "results_unsafe", "blocks_leaked", "rss_kb",
            "rss_growth_pct", "fds", "global_faults", "crashes", "data_plane_restarts"]
    print(json.dumps({k: report[k] for k in keys}, indent=1)[:4000])
    ok = report["lost"] == 0 and report["corrupted_bytes"] == 0 and \
        report["late_landing_bytes"] == 0 and report["blocks_leaked"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
