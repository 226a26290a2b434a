"""Deterministic simulation of producers and consumers (``python -m kvpush.testing.sim``).

The production driver, sessions and protocol cores run unchanged, stepped on a simulated
clock over the fakes of :mod:`kvpush.testing.fakes` (:mod:`kvpush.testing.driver`), with
engine models
(:mod:`kvpush.testing.engines`) that write real bytes and check every invariant of
docs/PROTOCOL.md as it happens. One ``random.Random(seed)`` draws everything (arrivals,
delays, faults, block ids, transfer ids), and time is simulated, so a seed replays exactly::

    python -m kvpush.testing.sim --requests 20000 --seed=7
    python -m kvpush.testing.sim --requests 2000 --seed=7 --producers 16 --consumers 16

The last line reads ``requests=N faults=F violations=V``; the exit code is 1 when V > 0.
Each violation prints its seed, step and the trace's tail.

Workload: requests arrive at random; each goes to a producer (or a group of ``--tp``
producer ranks) and a consumer (several sharing the source, or a group of ``--ctp`` decode
ranks), push or pull, 1-4 blocks, some layer-wise, some prefix hits. Engines call in at any
moment: prefill early or late, aborts from either side, request ids reused, a pull ticket
handed to two consumers or relayed after its lease, claims. Faults (``--faults``): link cuts
(frames held; a cut past ``peer_timeout_s`` breaks the connection), loop stalls, kills and
restarts, close and reopen over the same cache, duplicated idempotent frames, transfers in
error, slow or finishing inside the post, late notifications, clock skew, a producer
dialled under another spelling of its address (host name, IP) while its session is up or
being made. Every ``epoch`` requests the run quiesces: every open request must end, and
``tombstone_s`` later no core may hold a record or a transfer. See docs/SIMULATION.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import msgspec

from .. import messages as m
from ..errors import KvpushError, RequestAborted
from ..metrics import LIVE
from ..request import RequestState, TransferMode
from .checker import Checker
from .driver import Endpoint, SimNetwork, spellings
from .engines import DecodeEngine, Request, Source, Use
from .fakes import FakeMemory, FakeNixl, Network, Scheduler, Transfer

__all__ = ["FAULTS", "CoreFactory", "Faults", "Simulation", "Timings", "main"]

CoreFactory = Callable[[Endpoint], Any]


@dataclass(frozen=True)
class Timings:
    """Durations (simulated seconds) and sizes of a simulation. Short on purpose: faults
    outlast timeouts often, so every timeout path runs."""

    num_regions: int = 3          # layers (regions, or region pairs with kv_apart)
    kv_apart: bool = False        # K and V of a layer in regions of their own
    num_blocks: int = 128
    tp: int = 1                   # producer ranks per request (tensor parallel)
    ctp: int = 1                  # consumer ranks per request, sharing each source
    # producer
    lease_s: float = 1.0
    max_wait_s: float = 2.0
    transfer_timeout_s: float = 0.4
    tombstone_s: float = 2.0
    # consumer
    request_timeout_s: float = 1.5
    abort_grace_s: float = 0.3
    lease_margin_s: float = 0.05
    connect_timeout_s: float = 0.5   # a claim's or pull's Dial of a producer not connected
    # both
    heartbeat_s: float = 0.25
    peer_timeout_s: float = 1.0
    verify: bool = False          # per-block checksums travel with the data (both sides)
    # engines
    quarantine_s: float = 5.0
    prefill_max_s: float = 0.03
    expect_max_s: float = 0.01
    relay_max_s: float = 0.01
    max_request_blocks: int = 4
    layerwise_p: float = 0.2      # share of pushes written layer by layer
    tail_p: float = 0.15          # share of requests whose consumers hold a prefix already
    inline_p: float = 0.2         # share of transfers done inside the post call
    named_p: float = 0.5          # share of pushes whose source uses the router names
    # checks: slack on deadlines (timers fire at their time; messages take a little)
    slack_s: float = 0.05

    #: ``--timings`` choices: these short ones (transfer_timeout_s < peer_timeout_s = lease_s
    #: < max_wait_s = tombstone_s: faults outlast timeouts often), the library's defaults
    #: scaled down (heartbeat_s < abort_grace_s < peer_timeout_s < transfer_timeout_s <
    #: lease_s < request_timeout_s = tombstone_s < max_wait_s), or an order drawn per run.
    KINDS = ("sim", "library", "drawn")

    def with_order(self, kind: str, seed: int) -> Timings:
        """These timings with the timeouts of ``kind`` (see :data:`KINDS`); "drawn" draws
        each timeout from ``seed`` alone (the run's own random stream is left as it is)."""
        if kind == "sim":
            return self
        if kind == "library":
            # ProducerConfig / ConsumerConfig defaults / 60: 60 s of lease is 1 s here
            return replace(self, heartbeat_s=1 / 60, abort_grace_s=5 / 60,
                           peer_timeout_s=20 / 60, transfer_timeout_s=30 / 60, lease_s=1.0,
                           request_timeout_s=2.0, tombstone_s=2.0, max_wait_s=10.0,
                           lease_margin_s=1 / 60)
        if kind != "drawn":
            raise ValueError(f"timings are one of {', '.join(self.KINDS)}, got {kind!r}")
        import random
        rng = random.Random(seed * 7919 + 17)
        peer = rng.uniform(0.3, 2.0)
        lease = rng.uniform(0.3, 3.0)
        return replace(self, peer_timeout_s=peer, heartbeat_s=peer / rng.uniform(3, 10),
                       transfer_timeout_s=rng.uniform(0.2, 3.0), lease_s=lease,
                       max_wait_s=rng.uniform(0.3, 10.0),
                       tombstone_s=rng.uniform(0.3, 5.0),
                       request_timeout_s=rng.uniform(0.5, 3.0),
                       abort_grace_s=rng.uniform(0.05, 0.5),
                       lease_margin_s=min(0.05, lease / 10))


#: Fault names for ``--faults`` (comma separated; "all", "none").
FAULTS = ("cut", "stall", "kill", "dup", "xerr", "slow", "abort", "pabort", "reuse",
          "double", "late", "sharers", "skew", "claim", "close", "slownotif", "twice",
          "order", "inuse", "reset", "retry", "forge", "twin", "plane", "jump")
#: Faults that come at ``Faults.rate`` per simulated second rather than per request.
_PROCESS_FAULTS = frozenset({"cut", "stall", "kill", "close", "reset", "plane", "jump"})


@dataclass(frozen=True)
class Faults:
    """What goes wrong, and how often. Per-request chances are per request; process faults
    (cut, stall, kill) come at ``rate`` per simulated second, spread over their kinds."""

    enabled: frozenset[str] = frozenset(FAULTS)
    rate: float = 1.5            # process faults per simulated second
    dup_p: float = 0.05
    xerr_p: float = 0.02
    slow_p: float = 0.02
    abort_p: float = 0.04
    pabort_p: float = 0.02
    reuse_p: float = 0.05
    double_p: float = 0.03
    late_p: float = 0.02
    sharers_p: float = 0.05
    skew_s: float = 0.02         # wall clocks differ by up to this (pull tickets' leases)
    jump_s: float = 0.1          # a process's wall clock steps by up to this ("jump")
    claim_p: float = 0.1         # a pull or push is claimed first (the engine has no blocks)
    slownotif_p: float = 0.02    # a NIXL notification is read late (the target polls late)
    twice_p: float = 0.02        # the engine calls prefill_done twice for one use
    order_p: float = 0.5         # an aborting engine aborts twice, or still calls
                                 # prefill_done for the use it aborted (racing its abort)
    inuse_p: float = 0.3         # a request id reused while its previous use is held
    retry_p: float = 0.3         # a decode engine retries a push that failed or timed out
    forge_rate: float = 2.0      # attacker frames per simulated second (with a key)
    twin_rate: float = 1.0       # a consumer dials a producer it has, or is dialling, under
                                 # another spelling of its address: per simulated second
    twin_p: float = 0.3          # ... or within the handshake of a new dial, per dial
    twin_keep_p: float = 0.3     # a second spelling the engine keeps dialled (redialled
                                 # with the first after a loss: the two race)

    def on(self, name: str) -> bool:
        return name in self.enabled

    @classmethod
    def parse(cls, spec: str) -> Faults:
        if spec in ("", "all"):
            return cls()
        if spec == "none":
            return cls(enabled=frozenset())
        names = frozenset(s.strip() for s in spec.split(",") if s.strip())
        unknown = names - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
        return cls(enabled=names)


@dataclass
class _Epoch:
    rids: set[str] = field(default_factory=set)
    issued: int = 0
    # When a producer core last took a message that starts a wait of its own (Register,
    # Claim) for one of this epoch's ids: such a wait may outlive the consumer's request (the
    # message came late, its Abort was lost), and the record's tombstone starts at its end.
    last_wait_start: float = -math.inf
    quiet_since: float = math.inf   # when the epoch's last open request ended


@contextlib.contextmanager
def live_counts_kept() -> Iterator[None]:
    """The drivers and cores count live resources in the process-wide
    :data:`kvpush.metrics.LIVE`; simulated ones are not the process's, so the counts go
    back to what they were when this ends."""
    with LIVE._lock:
        before = dict(LIVE._counts)
    try:
        yield
    finally:
        with LIVE._lock:
            LIVE._counts.clear()
            LIVE._counts.update(before)


class Simulation:
    """A cluster of ``producers`` x ``consumers`` endpoints under one seed.

    ``make_producer`` / ``make_consumer`` build a protocol core for an endpoint (defaults:
    the real :class:`~kvpush.protocol.producer.ProducerCore` and
    :class:`~kvpush.protocol.consumer.ConsumerCore`); tests wrap them to plant bugs.
    """

    def __init__(self, seed: int, *, producers: int = 2, consumers: int = 2,
                 requests: int = 1000, rate: float | None = None,
                 timings: Timings | None = None, faults: Faults | None = None,
                 epoch: int = 2000, make_producer: CoreFactory | None = None,
                 make_consumer: CoreFactory | None = None, out: Any = None,
                 progress_every: int = 0, stop_after: int = 0, auth: bool = True) -> None:
        if isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 0:
            raise ValueError(f"stop_after must be an int >= 0, got {stop_after!r}")
        self.seed = seed
        # Every control frame and notification authenticated with a shared key (as with
        # ProducerConfig.auth_key / ConsumerConfig.auth_key), or none; nonces are drawn from
        # the seed, so a run replays exactly.
        self.auth_key: bytes | None = b"kvpush-simulated-key" if auth else None
        self._nonces = random.Random(seed * 104729 + 7)
        # the last control frames sent, (sender, receiver, frame): what an attacker on the
        # network could capture and replay ("forge")
        self.captured: deque[tuple[str, str, bytes]] = deque(maxlen=64)
        self.hellos: deque[tuple[str, str, bytes]] = deque(maxlen=8)
        self.timings = timings or Timings()
        self.faults = faults or Faults()
        self.sched = Scheduler(seed)
        self.rng = self.sched.rng
        self.checker = Checker(seed, out=out)
        self.checker.clock = self.sched
        self.out = out if out is not None else sys.stdout
        self.net = Network(self.sched)
        self.net.dup_p = self.faults.dup_p if self.faults.on("dup") else 0.0
        self.net.reset_s = self.timings.peer_timeout_s
        self.nixl = FakeNixl(self.sched)
        self.nixl.on_piece = self._on_piece
        self.nixl.on_landed = self._on_landed
        self.nixl.on_error = self._on_error
        self.nixl.on_stopped = self._on_stopped
        self.nixl.link_cut_until = lambda a, b: self.net.cut_until(a.name, b.name)
        self.nixl.stalled_until = lambda a: a.stalled_until
        self.stats: Counter[str] = Counter()
        self.make_producer = make_producer or default_producer
        self.make_consumer = make_consumer or default_consumer
        self.requests = requests
        self.epoch_size = max(1, epoch)
        self.progress_every = progress_every
        self.stop_after = stop_after   # 0: run to the end
        self.producer_names = [f"p{i}" for i in range(producers)]
        self.consumer_names = [f"c{i}" for i in range(consumers)]
        # every producer is reachable under several spellings of its address (fault "twin")
        self.addresses = {p: spellings(p, i) for i, p in enumerate(self.producer_names)}
        self._address_of = {a: p for p, spelt in self.addresses.items() for a in spelt}
        self.wire = SimNetwork(self)   # the endpoints' sockets, over self.net
        # ~concurrency of a few requests per producer at a time
        self.rate = rate if rate is not None else 40.0 * producers
        self.endpoints: dict[str, Endpoint] = {}
        self._heads: dict[str, tuple[int, int, int]] = {}
        self.reuse_tag = 0
        self.faults_injected = 0
        self.issued = 0
        self.finished = 0
        self._number = 0
        self._epoch = _Epoch()
        self._live_rids: Counter[str] = Counter()     # requests open per id
        self._latest: dict[str, Request] = {}          # the last request of each id
        self._reusable: deque[str] = deque(maxlen=256)
        self._held_by_producer: deque[Request] = deque(maxlen=64)   # see _pick_in_use
        self._open: dict[Request, None] = {}   # ordered: requests hash by identity
        self._quiescing = False
        self._done = False
        self.stopped_early = False
        self._wall0 = 0.0

    # -- setup -------------------------------------------------------------------------
    def nonce(self) -> bytes:
        """A handshake nonce (16 bytes, from the seed)."""
        return self._nonces.randbytes(16)

    def sent_frame(self, src: str, dst: str, frame: bytes, hello: bool = False) -> None:
        if "forge" in self.faults.enabled:
            (self.hellos if hello else self.captured).append((src, dst, frame))

    def producer_at(self, address: str) -> str:
        """The producer ``address`` reaches ("" for none)."""
        return self._address_of.get(address, "")

    def heads_of(self, name: str) -> tuple[int, int, int]:
        """(first head, heads, total heads) an endpoint holds. Producers form groups of
        ``tp`` ranks (p0..p{tp-1}, ...), consumers groups of ``ctp`` ranks; a rank holds its
        share of ``lcm(tp, ctp)`` heads."""
        known = self._heads.get(name)
        if known is not None:
            return known
        t = self.timings
        total = t.tp * t.ctp // math.gcd(t.tp, t.ctp)
        if name in self.producer_names:
            k, rank = t.tp, self.producer_names.index(name) % t.tp
        else:
            k, rank = t.ctp, self.consumer_names.index(name) % t.ctp
        known = self._heads[name] = (rank * (total // k), total // k, total)
        return known

    def _overlaps(self, producer: str, consumer: str) -> bool:
        p0, pn, _ = self.heads_of(producer)
        c0, cn, _ = self.heads_of(consumer)
        return max(p0, c0) < min(p0 + pn, c0 + cn)

    def _share(self, req: Request, consumer: str) -> tuple[list[str], list[int]]:
        """The producer ranks ``consumer`` takes heads from, and each one's sharers (how
        many of the request's consumer ranks take heads of it)."""
        mine = [p for p in req.producers if self._overlaps(p, consumer)]
        return mine, [sum(self._overlaps(p, c) for c in req.consumers) * req.sharers
                      for p in mine]

    def peer_memory(self, name: str) -> FakeMemory | None:
        ep = self.endpoints.get(name)
        return ep.memory if ep is not None else None

    def _spawn(self, name: str, role: str, inc: int,
               reopen: Endpoint | None = None) -> Endpoint:
        factory = self.make_producer if role == "producer" else self.make_consumer
        ep = Endpoint(self, name, role, inc, factory, reopen)
        if self.faults.on("skew"):
            ep.clock_skew = self.rng.uniform(-self.faults.skew_s, self.faults.skew_s)
        self.endpoints[name] = ep
        if role == "consumer":
            # a producer holding none of its heads would refuse the handshake (the layouts
            # cannot exchange blocks), as a real one does: it is not dialled
            for p in self.producer_names:
                if self._overlaps(p, name):
                    ep.connect(p)
        return ep

    # -- the run -----------------------------------------------------------------------
    def run(self) -> int:
        """Run to the end, or until ``stop_after`` violations were found (when it is not
        0); return the number of violations. A stopped run is the same run cut short: its
        violations are the first ones the whole run would report."""
        self._wall0 = time.perf_counter()
        with live_counts_kept():
            return self._run()

    def _run(self) -> int:
        for p in self.producer_names:
            self._spawn(p, "producer", 0)
        for c in self.consumer_names:
            self._spawn(c, "consumer", 0)
        self.sched.after(0.2, self._arrive)          # handshakes first
        if self.faults.enabled & _PROCESS_FAULTS and self.faults.rate > 0:
            self.sched.after(self.rng.expovariate(self.faults.rate), self._process_fault)
        if self.faults.on("forge") and self.auth_key is not None:
            self.sched.after(self.rng.expovariate(self.faults.forge_rate), self._forge)
        if self.faults.on("twin") and self.faults.twin_rate > 0:
            self.sched.after(self.rng.expovariate(self.faults.twin_rate), self._twin)
        chk = self.checker
        sched = self.sched
        stop = self.stop_after
        if stop:
            while not self._done and sched.step():
                if len(chk.violations) >= stop:
                    self.stopped_early = True
                    break
        else:
            while not self._done and sched.step():
                pass
        return len(chk.violations)

    def summary(self) -> str:
        return (f"requests={self.issued} faults={self.faults_injected} "
                f"violations={len(self.checker.violations)}")

    def details(self) -> str:
        wall = time.perf_counter() - self._wall0
        s = self.stats
        results = " ".join(f"{k[8:]}={v}" for k, v in sorted(s.items())
                           if k.startswith("results_"))
        return (f"seed={self.seed} steps={self.sched.steps} sim_time={self.sched.now:.1f}s "
                f"wall={wall:.1f}s ({self.issued / max(wall, 1e-9):.0f} requests/s) "
                f"trace={self.checker.trace_hash:08x} skipped={s['skipped']} {results}"
                + (f" stopped_at_violation={self.stop_after}" if self.stopped_early else ""))

    # -- arrivals ----------------------------------------------------------------------
    def _arrive(self) -> None:
        if self.issued >= self.requests:
            self._quiesce()
            return
        if self._epoch.issued >= self.epoch_size:
            self._quiesce()
            return
        self.sched.after(self.rng.expovariate(self.rate), self._arrive)
        if not self._new_request():
            return             # skipped (no instance up, no free blocks): not a request
        self.issued += 1
        self._epoch.issued += 1
        if self.progress_every and self.issued % self.progress_every == 0:
            wall = time.perf_counter() - self._wall0
            print(f"progress: requests={self.issued} faults={self.faults_injected} "
                  f"violations={len(self.checker.violations)} sim_time={self.sched.now:.1f}s "
                  f"wall={wall:.1f}s", file=self.out, flush=True)

    def _pick_rid(self) -> str:
        if self.faults.on("reuse") and self._reusable and self.rng.random() < self.faults.reuse_p:
            rid = self._reusable.popleft()
            if rid not in self._live_rids:
                self._fault("reuse")
                return rid
        self._number += 1
        return f"r{self._number}"

    def _pick_in_use(self) -> Request | None:
        """With ``inuse``: a push whose source uses the router named, whose consumers are
        done with it while its producer still holds the source (e.g. for a sharer that has
        not come), to send again under its id: the router reuses ids early."""
        while self._held_by_producer:
            old = self._held_by_producer.popleft()
            if old.finished or old.producer_done or self._latest.get(old.rid) is not old \
                    or not all(self.endpoints[n].open for n in old.producers + old.consumers):
                continue
            if self.rng.random() < self.faults.inuse_p:
                self._fault("inuse")
                return old
        return None

    def _new_request(self) -> bool:
        """Start a request; False when it is skipped (nothing up, no free blocks)."""
        rng, f, t = self.rng, self.faults, self.timings
        # the router sends requests to instances that are up
        def live_groups(names: list[str], k: int) -> list[list[str]]:
            groups = [names[i:i + k] for i in range(0, len(names) - k + 1, k)]
            return [g for g in groups if all(self.endpoints[n].open for n in g)]

        live_g = live_groups(self.producer_names, t.tp)
        live_cg = live_groups(self.consumer_names, t.ctp)
        if not live_g or not live_cg:
            self.stats["skipped"] += 1
            return False
        group = rng.choice(live_g)
        mode = TransferMode.PUSH if rng.random() < 0.6 else TransferMode.PULL
        sharers = 1
        if t.ctp > 1:        # decode ranks share the source, each its heads
            consumers = rng.choice(live_cg)
        else:
            live_c = [g[0] for g in live_cg]
            if f.on("sharers") and len(live_c) > 1 and rng.random() < f.sharers_p:
                sharers = rng.randint(2, min(3, len(live_c)))   # whole copies, shared
                self._fault("sharers")
            consumers = rng.sample(live_c, sharers)
        old = self._pick_in_use() if f.on("inuse") else None
        if old is not None:
            # The router sends it again under its id, naming the source uses to both
            # sides (as vLLM's scheduler does in tickets), as it named the held one: a
            # registration that names none cannot be told from a late one of the held use,
            # or from a retry.
            rid, group, consumers = old.rid, old.producers, old.consumers
            mode, sharers = old.mode, old.sharers
        else:
            rid = self._pick_rid()
        self.reuse_tag += 1
        req = Request(rid, self.reuse_tag, mode, group[0], rng.randint(1, t.max_request_blocks),
                      sharers, producers=list(group), consumers=list(consumers))
        if mode is TransferMode.PUSH and (old is not None or rng.random() < t.named_p):
            req.sids = {p: rng.getrandbits(63) | 1 for p in group}
        if old is None:
            for p in group:
                src = self.endpoints[p].engine.allocate(req)
                if src is None:
                    for s in req.sources:
                        s.ep.engine.give_back(s)
                    self.stats["skipped"] += 1
                    return False
                src.sid = req.sids.get(p, 0)
                req.sources.append(src)
            req.open_sources = len(req.sources)
        if req.nblocks > 1 and rng.random() < t.tail_p:
            req.tail = rng.randint(1, req.nblocks - 1)      # source_tail: a prefix hit
        self._live_rids[rid] += 1
        self._latest[rid] = req
        self._epoch.rids.add(rid)
        self._open[req] = None
        now = self.sched.now
        prefill = rng.uniform(0, t.prefill_max_s)
        if f.on("late") and rng.random() < f.late_p:
            # prefill very late, but within the time a use released early (layer-wise)
            # waits for its prefill_done (tombstone_s, then max_wait_s): a later one starts
            # a new use, as documented, which an engine does not make of the same blocks
            late = min(t.request_timeout_s * 1.5, t.tombstone_s + t.max_wait_s - t.slack_s)
            prefill = rng.uniform(min(t.lease_s, late), late)
            self._fault("late")
        layerwise = mode is TransferMode.PUSH and rng.random() < t.layerwise_p
        if layerwise:
            req.groups = t.num_regions                 # one per layer
            self.stats["layerwise"] += 1
        if old is not None:
            # the prefill engine starts it once the previous use's blocks are back
            req.pending += 1
            self.sched.after(0.0, self._start_sources, req, prefill, now)
        else:
            self._schedule_prefill(req, prefill)
        if mode is TransferMode.PUSH:
            for c in consumers:
                req.pending += 1
                at = now + rng.uniform(0, t.expect_max_s)
                if f.on("claim") and rng.random() < f.claim_p:
                    self._fault("claim")   # no blocks yet: claim now, expect later
                    self.sched.at(at, self._claim_push, req, c)
                else:
                    self.sched.at(at, self._expect, req, c)
        if f.on("abort") and rng.random() < f.abort_p:
            self._fault("abort")
            self.sched.at(now + rng.uniform(0, prefill + 0.05), self._consumer_abort, req,
                          rng.choice(consumers))
        if f.on("pabort") and rng.random() < f.pabort_p and old is None:
            self._fault("pabort")
            req.order = f.on("order") and rng.random() < f.order_p
            when = now + rng.uniform(0, prefill + 0.05)   # the engine aborts every rank
            for src in req.sources:
                self.sched.at(when, self._producer_abort, req, src)
        return True

    def _start_sources(self, req: Request, prefill: float, since: float) -> None:
        """An ``inuse`` request's prefill: its engine starts it once the previous use of
        the id has its blocks back (it runs one use of an id at a time)."""
        t = self.timings
        busy = [p for p in req.producers if req.rid in self.endpoints[p].engine.sources]
        gave_up = self.sched.now - since > t.max_wait_s + t.lease_s + t.request_timeout_s
        if busy and not gave_up:
            self.sched.after(0.02, self._start_sources, req, prefill, since)
            return
        req.pending -= 1
        for p in [] if gave_up else req.producers:
            src = self.endpoints[p].engine.allocate(req)
            if src is None:
                break
            src.sid = req.sids.get(p, 0)
            req.sources.append(src)
        if len(req.sources) < len(req.producers) or not req.sources:
            for s in req.sources:           # the router gives the request up
                s.ep.engine.give_back(s)
            req.sources.clear()
            req.producer_done = True
            self._maybe_finished(req)
            return
        req.open_sources = len(req.sources)
        self._schedule_prefill(req, prefill)

    def _schedule_prefill(self, req: Request, prefill: float) -> None:
        rng, now = self.rng, self.sched.now
        for src in req.sources:                        # the ranks end at about one time
            done = prefill + rng.uniform(0, 2e-3) * (len(req.sources) > 1)
            req.pending += 1
            self.sched.at(now + done, self._prefill_done, req, src)
            for layer in range(req.groups - 1):        # the last is final at prefill_done
                req.pending += 1
                self.sched.at(now + done * rng.uniform(0.1, 0.9) ** (1 / (layer + 1)),
                              self._layer_done, req, src, layer)

    # -- producer engine calls ---------------------------------------------------------
    def _producer_now(self, src: Source) -> Endpoint:
        """The incarnation the engine talks to now: a reopened endpoint over the same
        cache takes over its sources; a killed one's sources died with it."""
        cur = self.endpoints[src.ep.name]
        if cur.engine is src.ep.engine:
            src.ep = cur
        return src.ep

    def _prefill_done(self, req: Request, src: Source) -> None:
        pe = self._producer_now(src)
        req.pending -= 1
        if not pe.open:
            if pe.engine.dead:
                self.source_ended(src)
            elif not src.handed:      # closed: the call raises ClosedError, the engine
                pe.engine.give_back(src)  # keeps its blocks
                self.source_ended(src)
            elif not req.p_aborted:   # (aborted: the engine was done with them at the
                # abort, and their release frees them: freeing here too frees them twice)
                # layers went to kvpush before the close: it releases them (CLOSED); the
                # engine then frees them
                src.engine_done = True
                if src.released:
                    pe.engine.give_back(src)
                    self.source_ended(src)
            self._maybe_finished(req)
            return
        if req.p_aborted and req.order and not self._took_release_long_ago(src):
            # The engine's prefill_done for the use it aborted, made before it took the
            # release from its queue: kvpush releases the blocks exactly once (a layer-wise
            # use's, held since layer_done, by the abort already: this call changes
            # nothing). Blocks it never handed over it hands now, and gets back.
            self._fault("order")
            if src.released and src.released_by is not pe:
                # Released by an endpoint since closed (the abort's release, or the
                # close's): the engine has its blocks back and does not hand them to the
                # new one, which would take the call for a new use (as prefill_done and
                # layer_done above and below).
                self._maybe_finished(req)
                return
            if not src.released:
                pe.engine.prefill_done(src)
            if not src.sid:
                src.sid = self.rng.getrandbits(63) | 1
            self.checker.trace(f"{pe.name} engine prefill_done {req.rid} after its abort "
                               f"sid={src.sid:x} ids={src.ids.tolist()}")
            pe.run(lambda: pe.core.prefill_done(self.sched.now, req.rid, src.ids, req.mode,
                                                src.sid))
            self._maybe_finished(req)
            return
        if req.p_aborted:
            if not src.handed:        # kvpush never had them: the engine frees them
                pe.engine.give_back(src)
                self.source_ended(src)
            self._maybe_finished(req)  # else kvpush releases them (see _producer_abort)
            return
        early = src.released          # layer-wise: kvpush gave them back already
        pe.engine.prefill_done(src)   # the engine wrote the KV: these are the bytes
        if not src.sid:
            src.sid = self.rng.getrandbits(63) | 1
        self.checker.trace(f"{pe.name} engine prefill_done {req.rid} "
                           f"{req.mode.value} sid={src.sid:x} ids={src.ids.tolist()}")
        if not early or src.released_by is pe:
            # (the endpoint that released them early swallows this call; a new one, after
            # a close, would take it as a new use: the engine does not make it)
            pe.run(self._call_prefill_done, pe, req, src)
        if early:                     # and the engine is done with them now
            pe.engine.give_back(src)
            self.source_ended(src)
            return
        if req.mode is TransferMode.PULL:
            req.tickets[pe.name] = m.PullTicket(
                producer=pe.name, address=self.addresses[pe.name][0], request_id=req.rid,
                block_ids=m.encode_ids(src.ids), lease_s=self.timings.lease_s,
                issued_at=self.sched.now + pe.clock_skew, sid=src.sid,
                checksums=pe.links.checksums(src.ids) if self.timings.verify else b"")
            if len(req.tickets) < len(req.producers):
                return            # the router relays them once every rank's is there
            consumers = list(req.consumers)
            f, rng = self.faults, self.rng
            if f.on("double") and req.sharers == 1 and self.timings.ctp == 1 \
                    and len(self.consumer_names) > 1 and rng.random() < f.double_p:
                self._fault("double")
                consumers.append(rng.choice([c for c in self.consumer_names
                                             if c not in consumers]))
            for c in consumers:
                ticket = [req.tickets[p] for p in req.producers if self._overlaps(p, c)]
                delay = rng.uniform(0, self.timings.relay_max_s)
                if f.on("late") and rng.random() < f.late_p:
                    self._fault("late")
                    delay = rng.uniform(self.timings.lease_s * 0.8, self.timings.lease_s * 1.5)
                req.pending += 1
                if f.on("claim") and rng.random() < f.claim_p:
                    self._fault("claim")
                    self.sched.after(delay, self._claim, req, c, ticket)
                else:
                    self.sched.after(delay, self._pull, req, c, ticket)

    def _layer_done(self, req: Request, src: Source, layer: int) -> None:
        pe = self._producer_now(src)
        req.pending -= 1
        if not pe.open or req.p_aborted or src.done_at >= 0:
            self._maybe_finished(req)
            return
        pe.engine.layer_done(src, layer)
        if not src.sid:
            src.sid = self.rng.getrandbits(63) | 1
        self.checker.trace(f"{pe.name} engine layer_done {req.rid} layer={layer}")
        if src.released and src.released_by is not pe:
            # Released (CLOSED) by an endpoint since closed: the engine has its blocks back
            # and does not hand them to the new one (as for prefill_done above).
            return
        pe.run(lambda: pe.core.layer_done(self.sched.now, req.rid, src.ids, layer, src.sid))

    def _call_prefill_done(self, pe: Endpoint, req: Request, src: Source) -> None:
        now = self.sched.now
        pe.core.prefill_done(now, req.rid, src.ids, req.mode, src.sid)
        if self.faults.on("twice") and self.rng.random() < self.faults.twice_p \
                and pe.core.snapshot(req.rid).phase in ("held", "partial", "ending"):
            # An engine bug: the same blocks handed over twice while kvpush holds them
            # (once released, a second call is a new use of the id, which is legal). They
            # must still be released exactly once.
            self._fault("twice")
            pe.core.prefill_done(now, req.rid, src.ids, req.mode, self.rng.getrandbits(63) | 1)
        # Its release must come within the producer's documented bounds: an unclaimed
        # source by its lease (then a READ begun inside it holds it transfer_timeout_s, an
        # abandoned WRITE's fence until its consumer acknowledges or is lost); a claimed
        # one by max_wait_s from its last claim (see _check_released).
        t = self.timings
        bound = now + t.lease_s + t.transfer_timeout_s + t.peer_timeout_s + t.heartbeat_s \
            + t.slack_s
        self.sched.at(bound, self._check_released, src, self._delayed_s(pe), bound)

    def _delayed_s(self, pe: Endpoint) -> float:
        """How much a producer's bounds have moved so far: its loop's stalls, and the cuts
        of its links (a consumer's frames held by a cut arrive when it heals and show it
        alive then, so an abandoned WRITE's fence, which waits for the consumer's Abort or
        its loss, ends up to the cut's length later); each as it elapses."""
        return pe.stalled_s() + self.net.held_s(pe.name)

    def _delaying_s(self, pe: Endpoint) -> float:
        """What is left of a stall of ``pe``'s loop or a cut of its links going on now."""
        return max(0.0, pe.stalled_until - self.sched.now) + self.net.held_for_s(pe.name)

    def _took_release_long_ago(self, src: Source) -> bool:
        """Whether the engine took the release of an aborted use so long ago that a
        prefill_done for it cannot have been made before: the core keeps the aborted use's
        record ``tombstone_s`` from its release, and takes a prefill_done after that for a
        new use, as documented. Half of it leaves room for the release's way to the engine."""
        return src.released and self.sched.now - src.released_at > self.timings.tombstone_s / 2

    def _producer_abort(self, req: Request, src: Source) -> None:
        pe = self._producer_now(src)
        if not pe.open:
            return
        if src.done_at < 0:
            # the engine stops prefilling; layers it already handed over (layer_done) are
            # kvpush's to release, and the engine frees them once released (not again if
            # it freed them already: released CLOSED, its prefill_done refused as closed)
            req.p_aborted = True
            src.engine_done = True
            if src.released and not src.ended:
                pe.engine.give_back(src)
                self.source_ended(src)
        self.checker.trace(f"{pe.name} engine abort {req.rid}")
        pe.run(self._call_abort, pe, req, src)
        if req.order and self.rng.random() < 0.3:
            self._fault("order")
            self.checker.trace(f"{pe.name} engine abort {req.rid} again")
            pe.run(lambda: pe.core.abort(self.sched.now, req.rid, "aborted twice"))

    def _call_abort(self, pe: Endpoint, req: Request, src: Source) -> None:
        now = self.sched.now
        # The use it aborts, named as the engine named it to prefill_done and layer_done
        # (none yet: unnamed, its next use whatever its sid); a stalled loop can take it
        # after that use ended and the id's next use began, which a named abort leaves be.
        pe.core.abort(now, req.rid, "aborted by the sim's engine", src.sid)
        if req.mode is TransferMode.PUSH and src.handed and not src.released:
            # A pushed source the engine gave up goes back once no WRITE can read it: each
            # WRITE ends or is abandoned within transfer_timeout_s of its post, and an
            # abandoned one's fence ends when the consumer acknowledges or is lost (silent
            # peer_timeout_s, seen at a liveness check). Nothing waits for a lease or
            # max_wait_s here (a fence must not wait max_wait_s for a consumer lost before
            # its WRITE was abandoned).
            t = self.timings
            bound = now + t.transfer_timeout_s + t.peer_timeout_s + t.heartbeat_s \
                + t.slack_s
            self.sched.at(bound, self._check_released, src, self._delayed_s(pe), bound,
                          "the engine's abort")

    def _check_released(self, src: Source, delayed0: float, bound: float,
                        since: str = "") -> None:
        pe = src.ep
        if src.released or pe.engine.dead or pe.engine.sources.get(src.req.rid) is not src:
            return
        t = self.timings
        if not since and src.claims:
            # A claim its consumer still has holds the source up to max_wait_s from when
            # the producer took it; one given up there, only until the producer is told
            # (its consumer's Abort, or that consumer's loss); one continued, as long as
            # the transfer that continues it (bounded as any transfer is).
            live = [taken for taken, gone in src.claims.values() if gone < taken]
            claimed = max(live) + t.max_wait_s if live \
                else max(gone for _, gone in src.claims.values())
            claimed += t.transfer_timeout_s + t.peer_timeout_s + t.heartbeat_s + t.slack_s
            if claimed > bound:
                self.sched.at(claimed, self._check_released, src, delayed0, claimed)
                return
        # what the producer's stalls and cuts moved the bound since it was set, and what is
        # left of a stall or cut still going on now (credited now: the recheck counts from
        # its end, so none of it is counted twice)
        ahead = self._delaying_s(pe)
        ext = self._delayed_s(pe) - delayed0 + ahead
        if ext > 1e-9:
            self.sched.after(ext, self._check_released, src, self._delayed_s(pe) + ahead,
                             bound + ext, since)
            return
        after = f" after {since}" if since else ""
        self.checker.fail("never_released",
                          f"{pe.name} still holds {src.req.rid!r} (sid {src.sid:x}, "
                          f"{src.req.mode.value}, prefill_done at {src.done_at:.6f}) past "
                          f"its bound{after} t={bound:.6f}; core says "
                          f"{pe.core.snapshot(src.req.rid).phase}")
        # Reported once; give the blocks back so the run goes on.
        pe.engine.give_back(src)
        self.source_ended(src)

    # -- consumer engine calls ---------------------------------------------------------
    def _expect(self, req: Request, cname: str,
                claim: tuple[Endpoint, int] | None = None) -> None:
        req.pending -= 1
        ce = self.endpoints[cname]
        if claim is not None and claim[0] is not ce:
            claim = None          # claimed by an incarnation that died since
        use = ce.engine.allocate(req) if ce.open else None
        if use is None:
            self.stats["skipped_uses"] += 1
            if claim is not None:   # the engine gives its claim up
                ce.run(lambda: ce.core.abort_claim(self.sched.now, req.rid, claim[1],
                                                   "no blocks"))
            self._maybe_finished(req)
            return
        self._begin_use(req, use)
        ce.run(self._call_expect, ce, use, claim[1] if claim else 0)

    def _claim_push(self, req: Request, cname: str) -> None:
        """The engine queues the request (no free blocks): claim its push, register (or
        give up) later -- possibly after the prefill's lease, which the claim extends."""
        ce = self.endpoints[cname]
        if not ce.open:
            req.pending -= 1
            self._maybe_finished(req)
            return
        xid = self.rng.getrandbits(63) | 1
        producers, shares = self._share(req, cname)
        self.checker.trace(f"{ce.name} engine claim_push {req.rid} xid={xid:x}")
        ce.run(lambda: ce.core.claim_push(self.sched.now, req.rid, producers, shares, xid))
        later = self.rng.uniform(0, self.timings.lease_s * 1.5)
        if self.rng.random() < 0.2:
            self.sched.after(later, self._unclaim, req, ce, xid)
        else:
            self.sched.after(later, self._expect, req, cname, (ce, xid))

    def _pull(self, req: Request, cname: str, ticket: list[m.PullTicket],
              claim: tuple[Endpoint, int] | None = None) -> None:
        req.pending -= 1
        ce = self.endpoints[cname]
        if claim is not None and claim[0] is not ce:
            claim = None          # claimed by an incarnation that died since
        use = ce.engine.allocate(req) if ce.open else None
        if use is None:
            self.stats["skipped_uses"] += 1
            if claim is not None:   # the engine gives its claim up
                ce.run(lambda: ce.core.abort_claim(self.sched.now, req.rid, claim[1],
                                                   "no blocks"))
            self._maybe_finished(req)
            return
        self._begin_use(req, use)
        ce.run(self._call_pull, ce, use, ticket, claim[1] if claim else 0)

    def _claim(self, req: Request, cname: str, ticket: list[m.PullTicket]) -> None:
        """The engine cannot take the blocks yet: claim the source, pull (or give up)
        later -- possibly after the ticket's lease, which the claim extends."""
        ce = self.endpoints[cname]
        if not ce.open:
            req.pending -= 1
            self._maybe_finished(req)
            return
        xid = self.rng.getrandbits(63) | 1
        self.checker.trace(f"{ce.name} engine claim {req.rid} xid={xid:x}")
        share = self._share(req, cname)[1][0]
        t = self.timings
        ce.run(lambda: ce.core.claim(self.sched.now, ticket, share, xid,
                                     dial_s=t.connect_timeout_s,
                                     lease_s=self._lease_left(ce, ticket)))
        later = self.rng.uniform(0, self.timings.lease_s * 1.5)
        if self.rng.random() < 0.2:
            self.sched.after(later, self._unclaim, req, ce, xid)
        else:
            self.sched.after(later, self._pull, req, cname, ticket, (ce, xid))

    def _unclaim(self, req: Request, ce: Endpoint, xid: int) -> None:
        req.pending -= 1
        if ce.open:
            self.checker.trace(f"{ce.name} engine abort_claim {req.rid} xid={xid:x}")
            ce.run(lambda: ce.core.abort_claim(self.sched.now, req.rid, xid, "gave up"))
        self._maybe_finished(req)

    def _begin_use(self, req: Request, use: Use) -> None:
        req.uses.append(use)
        req.open_uses += 1
        use.started = -1.0
        use.ep.engine.calling[use] = None

    def _started(self, ce: Endpoint, use: Use, xid: Any) -> None:
        now = self.sched.now
        if not isinstance(xid, int) or xid == 0:
            self.checker.fail("bad_xid", f"{ce.name}: the core returned xid {xid!r}")
            xid = self.rng.getrandbits(63) | 1
        ce.engine.calling.pop(use, None)
        ce.engine.started(use, xid)
        use.started = now
        t = self.timings
        use.deadline = now + t.request_timeout_s + t.abort_grace_s + t.slack_s
        use.stall0 = ce.stalled_s()
        self.sched.at(use.deadline, self._check_result, use, use.stall0, use.deadline)
        self.checker.trace(f"{ce.name} engine {use.req.mode.value} {use.req.rid} "
                           f"xid={xid:x} ids={use.ids.tolist()} sharers={use.req.sharers}")

    def _refused(self, ce: Endpoint, use: Use, exc: Exception) -> None:
        self.stats["refused_calls"] += 1
        self.checker.trace(f"{ce.name} engine call refused: {exc!r}")
        ce.engine.calling.pop(use, None)
        ce.engine.cancel(use)
        self.consumer_ended(use)

    def _call_expect(self, ce: Endpoint, use: Use, claimed: int = 0) -> None:
        xid = claimed or self.rng.getrandbits(63) | 1   # the facade draws it (new_xid)
        producers, shares = self._share(use.req, ce.name)
        named = {"sids": [use.req.sids[p] for p in producers]} if use.req.sids else {}
        try:
            xid = ce.core.expect(self.sched.now, use.req.rid, use.ids, producers,
                                 self.timings.request_timeout_s, use.req.groups,
                                 use.req.tail > 0, shares, xid, **named)
        except KvpushError as exc:
            self._refused(ce, use, exc)
            return
        self._started(ce, use, xid)

    def _call_pull(self, ce: Endpoint, use: Use, tickets: list[m.PullTicket],
                   claimed: int) -> None:
        k = use.req.tail                      # source_tail: as the facade slices them
        srcs = [m.decode_ids(t.block_ids)[k:] for t in tickets]
        if k and self.timings.verify:
            tickets = [msgspec.structs.replace(t, checksums=t.checksums[8 * k:])
                       for t in tickets]
        now = self.sched.now
        t = self.timings
        # as the facade: the READ's budget is the timeout and what is left of the leases
        # (judged on this side's own wall clock), or the whole timeout when claimed
        budget = t.request_timeout_s if claimed else min(
            t.request_timeout_s, self._lease_left(ce, tickets))
        xid = claimed or self.rng.getrandbits(63) | 1
        try:
            xid = ce.core.pull(now, tickets, srcs, use.ids, budget,
                               self._share(use.req, ce.name)[1][0], xid,
                               dial_s=t.connect_timeout_s)
        except KvpushError as exc:
            self._refused(ce, use, exc)
            return
        self._started(ce, use, xid)

    def _lease_left(self, ce: Endpoint, tickets: list[m.PullTicket]) -> float:
        """Seconds left of the tickets' leases less lease_margin_s, judged on ``ce``'s own
        wall clock (as the facade does)."""
        return min(k.issued_at + k.lease_s - self.timings.lease_margin_s
                   - (self.sched.now + ce.clock_skew) for k in tickets)

    def _consumer_abort(self, req: Request, cname: str) -> None:
        ce = self.endpoints[cname]
        if not ce.open:
            return
        now = self.sched.now
        use = ce.engine.by_rid.get(req.rid)
        if use is not None and use.req is req and use.started >= 0:
            # the result must come within abort_grace_s (documented), or its deadline
            use.deadline = min(use.deadline, now + self.timings.abort_grace_s
                               + self.timings.slack_s)
            self.sched.at(use.deadline, self._check_result, use, ce.stalled_s(), use.deadline)
        self.checker.trace(f"{ce.name} engine abort {req.rid}")
        ce.run(lambda: ce.core.abort(self.sched.now, req.rid, RequestState.ABORTED,
                                     RequestAborted("aborted by the sim's engine")))

    def _check_result(self, use: Use, stall0: float, bound: float) -> None:
        ce = use.ep
        if use.result is not None or ce.engine.dead or bound != use.deadline:
            return
        ahead = max(0.0, ce.stalled_until - self.sched.now)
        ext = ce.stalled_s() - stall0 + ahead
        if ext > 1e-9:
            use.deadline = bound + ext
            self.sched.after(ext, self._check_result, use, ce.stalled_s() + ahead,
                             use.deadline)
            return
        self.checker.fail("no_result_in_time",
                          f"{ce.name}: {use.req.rid!r} (xid {use.xid:x}, {use.req.mode.value} "
                          f"from {use.req.producer}) has no result by t={bound:.6f} "
                          f"(started {use.started:.6f})")

    # -- request bookkeeping -----------------------------------------------------------
    def source_ended(self, src: Source) -> None:
        """One rank's source is over (released, given back by the engine, or died)."""
        if src.ended:
            return
        src.ended = True
        req = src.req
        req.open_sources -= 1
        if req.open_sources <= 0:
            req.producer_done = True
        self._maybe_finished(req)

    def consumer_ended(self, use: Use) -> None:
        req = use.req
        f = self.faults
        if f.on("retry") and use.result is not None and not use.result.ok \
                and req.mode is TransferMode.PUSH and not req.retried \
                and not req.producer_done and self.rng.random() < f.retry_p:
            # The engine retries the same request (same bytes owed) under a new xid,
            # while the producer may still hold its source: served, or failed, never
            # another use's bytes.
            self._fault("retry")
            req.retried = True
            req.pending += 1
            self.sched.after(self.rng.uniform(0, 0.05), self._expect, req, use.ep.name)
        req.open_uses -= 1
        if req.open_uses == 0 and req.sids and not req.producer_done \
                and req.sources and all(s.done_at >= 0 for s in req.sources):
            self._held_by_producer.append(req)  # its consumers are done (see _pick_in_use)
        self._maybe_finished(req)

    def _rid_closed(self, rid: str) -> None:
        self._live_rids[rid] -= 1
        if self._live_rids[rid] <= 0:
            del self._live_rids[rid]
            self._latest.pop(rid, None)

    def _maybe_finished(self, req: Request) -> None:
        if req.finished or not req.producer_done or req.open_uses > 0 \
                or req.pending > 0:
            return
        req.finished = True
        self.finished += 1
        self._open.pop(req, None)
        self._rid_closed(req.rid)
        self._reusable.append(req.rid)

    # -- transfers ---------------------------------------------------------------------
    def _decode_engine(self, xfer: Transfer) -> DecodeEngine | None:
        """The decode engine whose KV cache ``xfer`` writes into (WRITE or READ)."""
        eng = xfer.dst.owner
        return eng if isinstance(eng, DecodeEngine) and not eng.dead else None

    def _use_of(self, xfer: Transfer) -> Use | None:
        eng = self._decode_engine(xfer)
        if eng is None:
            return None
        use: Use | None = eng.uses.get(xfer.xid) or eng.done.get(xfer.xid)
        return use

    def posted_from(self, mem: FakeMemory) -> list[Transfer]:
        """Transfers posted by any incarnation over ``mem`` whose end was not reported."""
        return [x for x in self.nixl.active.values()
                if x.src is mem and x.poster.memory is mem and not x.reported]

    def start_transfer(self, xfer: Transfer) -> None:
        f = self.faults
        if f.on("xerr") and self.rng.random() < f.xerr_p:
            self._fault("xerr")
            xfer.fail_at = self.rng.randint(0, 2)
        slow = 0.0
        if f.on("slow") and self.rng.random() < f.slow_p:
            self._fault("slow")
            slow = self.timings.transfer_timeout_s * 2.5
        use = self._use_of(xfer)
        if use is not None:
            use.moving += 1
            xfer.use = use
        self.nixl.start(xfer, slow)
        if not slow and xfer.fail_at < 0 and self.rng.random() < self.timings.inline_p \
                and not self.net.cut_until(xfer.poster.name, xfer.target.name):
            self.nixl.finish_now(xfer)   # the driver sees DONE inside its post call

    def _on_piece(self, xfer: Transfer, lo: int, hi: int) -> None:
        eng = self._decode_engine(xfer)
        if eng is not None:
            eng.on_landing(xfer, lo, hi)

    def _poll_delay(self) -> float:
        return self.rng.uniform(5e-6, 3e-4)

    def _on_landed(self, xfer: Transfer) -> None:
        poster = xfer.poster
        self.sched.after(self._poll_delay(), poster.transfer_moved)
        delay = self.rng.uniform(10e-6, 1e-3)
        f = self.faults
        if f.on("slownotif") and self.rng.random() < f.slownotif_p:
            self._fault("slownotif")
            delay += self.rng.uniform(0, 2 * self.timings.abort_grace_s)
        self._notify(xfer, delay)

    def _notify(self, xfer: Transfer, delay: float) -> None:
        self.sched.after(delay, self._deliver_notif, xfer)

    def _deliver_notif(self, xfer: Transfer) -> None:
        target = xfer.target
        if not target.alive:
            return
        until = self.net.cut_until(xfer.poster.name, target.name)
        if until:
            self.sched.at(until + self.rng.uniform(10e-6, 1e-3), self._deliver_notif, xfer)
            return
        target.notification(xfer.poster.name, xfer.notif)

    def _on_error(self, xfer: Transfer) -> None:
        poster = xfer.poster
        self.sched.after(self._poll_delay(), poster.transfer_moved)

    def _on_stopped(self, xfer: Transfer) -> None:
        use: Use | None = getattr(xfer, "use", None)
        if use is not None:
            use.moving -= 1
            use.ep.engine.transfer_stopped(use)
        if xfer.state == "dead" and xfer.poster.alive and not xfer.reported:
            poster = xfer.poster
            self.sched.after(self._poll_delay() + 1e-3, poster.transfer_moved)

    # -- faults ------------------------------------------------------------------------
    def _fault(self, name: str) -> None:
        self.faults_injected += 1
        self.stats["fault_" + name] += 1

    def _process_fault(self) -> None:
        if self._quiescing or self._done:
            return
        rng, t = self.rng, self.timings
        kinds = sorted(self.faults.enabled & _PROCESS_FAULTS)
        kind = rng.choice(kinds)
        now = self.sched.now
        if kind == "reset":
            # ZeroMQ over TCP loses frames only with a connection: those in flight when it
            # breaks. Reconnected at once, neither side notices (no peer loss).
            p, c = rng.choice(self.producer_names), rng.choice(self.consumer_names)
            self.net.reset(p, c)
            self.checker.trace(f"FAULT reset {p}-{c}")
        elif kind == "cut":
            p, c = rng.choice(self.producer_names), rng.choice(self.consumer_names)
            dur = rng.uniform(0.01, 2.5 * t.peer_timeout_s)
            self.net.cut(p, c, now + dur)
            self.checker.trace(f"FAULT cut {p}-{c} for {dur:.3f}s")
        elif kind == "plane":
            # the data-plane child of a process dies (a contained data plane): its
            # transfers stop, its sessions end and are made again over a new child
            name = rng.choice(self.producer_names + self.consumer_names)
            ep = self.endpoints[name]
            self.checker.trace(f"FAULT plane {name}#{ep.inc}")
            ep.lose_data_plane()
        elif kind == "jump":
            # a process's wall clock steps (NTP): what it judges by wall time (pull
            # tickets' leases, handshake frames' age) moves with it; its timers do not
            name = rng.choice(self.producer_names + self.consumer_names)
            ep = self.endpoints[name]
            step = rng.uniform(-self.faults.jump_s, self.faults.jump_s)
            ep.clock_skew += step
            self.checker.trace(f"FAULT jump {name} wall clock {step:+.3f}s")
        elif kind == "stall":
            name = rng.choice(self.producer_names + self.consumer_names)
            dur = rng.uniform(0.005, 2.0 * t.peer_timeout_s)
            ep = self.endpoints[name]
            if ep.alive:
                ep.stall(now + dur)
            self.checker.trace(f"FAULT stall {name} for {dur:.3f}s")
        elif kind == "close":
            name = rng.choice(self.producer_names + self.consumer_names)
            ep = self.endpoints[name]
            if ep.open:
                self.checker.trace(f"FAULT close {name}#{ep.inc} (reopened on its cache)")
                delay = rng.uniform(0.0, 0.05)
                ep.close(lambda: self.sched.after(delay, self._restart, name, ep.role,
                                                  ep.inc + 1, ep))
        else:
            name = rng.choice(self.producer_names + self.consumer_names)
            ep = self.endpoints[name]
            if not ep.alive:
                self.sched.after(rng.expovariate(self.faults.rate), self._process_fault)
                return
            self.checker.trace(f"FAULT kill {name}#{ep.inc}")
            ep.kill()
            self.sched.after(rng.uniform(0.1, 1.5), self._restart, name, ep.role, ep.inc + 1)
        self._fault(kind)
        self.sched.after(rng.expovariate(self.faults.rate), self._process_fault)

    def _forge(self) -> None:
        """An attacker on the control network (it has no key): it replays a frame it
        captured, to its receiver or to another endpoint of the same role, from its own
        connection or spliced into the sender's; or it sends a frame of its own. With a key,
        each may earn a refusal and nothing else (the driver checks); without one nothing is
        claimed (the key is what authenticates), so the fault needs one."""
        rng = self.rng
        if self._quiescing or self._done:
            return
        self.sched.after(rng.expovariate(self.faults.forge_rate), self._forge)
        hello = bool(self.hellos) and rng.random() < 0.5
        pool = self.hellos if hello else self.captured
        if not pool:
            return
        self._fault("forge")
        src, dst, frame = pool[rng.randrange(len(pool))]
        how = "elsewhere" if hello and rng.random() < 0.5 else \
            rng.choice(("replay", "elsewhere", "splice", "tamper", "plain"))
        sender = f"x{rng.randrange(4)}"
        if how == "elsewhere":   # e.g. a Hello captured on its way to one producer
            names = self.producer_names if dst in self.producer_names else self.consumer_names
            dst = rng.choice(names)
        elif how == "splice":    # replayed into the genuine sender's connection
            sender = src
        elif how == "tamper":
            i = rng.randrange(len(frame))
            frame = frame[:i] + bytes([frame[i] ^ (1 + rng.randrange(255))]) + frame[i + 1:]
        elif how == "plain":     # a frame of its own, unsealed, naming a real peer
            frame = m.encode(rng.choice((m.Bye(src), m.Heartbeat(1),
                                         m.Abort(f"r{rng.randrange(99)}", 1, "forged"))))
        target = self.endpoints.get(dst)
        self.checker.trace(f"FAULT forge {how} {src}>{dst} as {sender}")
        if target is not None and target.alive:
            self.net.send(sender, dst, frame, target.attacked)

    def _twin(self) -> None:
        """At a random moment (requests in flight, handshakes going on or not), a consumer
        dials a producer it has a session with, or is dialling, under another spelling."""
        rng = self.rng
        if self._quiescing or self._done:
            return
        self.sched.after(rng.expovariate(self.faults.twin_rate), self._twin)
        ce = self.endpoints[rng.choice(self.consumer_names)]
        dialled = [p for p in self.producer_names if self.addresses[p][0] in ce.dialing]
        if dialled:
            self.dial_twin(ce, rng.choice(dialled))

    def dial_twin(self, ce: Endpoint, producer: str) -> None:
        """``ce``'s engine calls ``connect()`` with another spelling of ``producer``'s
        address (the driver joins it to the session that reaches the producer, as
        ``Consumer`` does; see Endpoint.connect_twin)."""
        if not ce.open:
            return
        rng = self.rng
        others = self.addresses[producer][1:]
        # a spelling with no session yet, if one is left (else connect() returns at once)
        address = rng.choice([a for a in others if a not in ce.dialers.by_address] or others)
        keep = rng.random() < self.faults.twin_keep_p
        if address in ce.dialing:   # the engine stops dialling it (its session stays)
            ce.dialing.discard(address)
            keep = False
        self._fault("twin")
        if self._open:
            self.stats["twin_with_requests_open"] += 1
        d = ce.dialers.by_address.get(self.addresses[producer][0])
        self.checker.trace(f"FAULT twin {ce.name} dials {producer} at {address}"
                           f"{' (kept)' if keep else ''}; its session is "
                           f"{d.state.value if d is not None else 'none'}")
        ce.run(ce.connect_twin, producer, address, keep)

    def _restart(self, name: str, role: str, inc: int, reopen: Endpoint | None = None) -> None:
        self.checker.trace(f"FAULT restart {name}#{inc}")
        self._spawn(name, role, inc, reopen)

    # -- quiescence --------------------------------------------------------------------
    def _quiesce(self) -> None:
        """No new requests until every open one has ended; then, after ``tombstone_s``,
        no core may hold any record of this epoch's request ids."""
        self._quiescing = True
        self.sched.after(0.05, self._quiesce_wait, self.sched.now)

    def _quiesce_wait(self, since: float) -> None:
        t = self.timings
        limit = since + max(t.lease_s, t.max_wait_s) + t.request_timeout_s + 3 * t.peer_timeout_s \
            + t.transfer_timeout_s + 10.0
        if self._open and self.sched.now < limit:
            self.sched.after(0.05, self._quiesce_wait, since)
            return
        for req in list(self._open):
            self.checker.fail("request_never_ended",
                              f"{req.rid!r} ({req.mode.value} from {req.producer}) has not "
                              f"ended: producer_done={req.producer_done} "
                              f"open_uses={req.open_uses}")
            if not req.finished:
                req.finished = True
                self._rid_closed(req.rid)
            self._open.pop(req, None)
        self.sched.after(0.0, self._quiesce_check)

    def producer_wait_started(self, rid: str) -> None:
        """A producer core took a Register or Claim for ``rid`` just now (see
        :class:`_Epoch`)."""
        if rid in self._epoch.rids:
            self._epoch.last_wait_start = self.sched.now

    def _quiesce_check_at(self) -> float:
        """When every record of the epoch must be gone: ``tombstone_s`` after the last
        request ended or after the longest producer wait started since then could end (a
        Register delayed past its consumer's request holds the record until its wait, then
        its tombstone, ends)."""
        t = self.timings
        ended = max(self._epoch.quiet_since, self._epoch.last_wait_start + t.max_wait_s)
        return ended + t.tombstone_s + t.slack_s + 0.1

    def _quiesce_check(self) -> None:
        if math.isinf(self._epoch.quiet_since):
            self._epoch.quiet_since = self.sched.now
        at = self._quiesce_check_at()
        if self.sched.now < at:
            self.sched.after(at - self.sched.now, self._quiesce_check)
            return
        chk, t = self.checker, self.timings
        for ep in self.endpoints.values():
            if not ep.alive:
                continue
            if ep.role == "consumer":
                ep.engine.release_quarantine()
                late = ep.unresolved(self.sched.now - 5 * t.peer_timeout_s - 3.0)
                if late and ep.open:
                    chk.fail("connect_unresolved", f"{ep.name}: connect() calls never "
                             f"answered: {late[:3]}")
            n = ep.core.in_flight()
            if n:
                chk.fail("state_unbounded", f"{ep.name}: in_flight()={n} once quiet")
            left = [(rid, st) for rid in sorted(self._epoch.rids)
                    if (st := ep.core.snapshot(rid).phase) != "none"]
            if left:
                chk.fail("state_unbounded",
                         f"{ep.name}: {len(left)} request record(s) left once quiet and "
                         f"past tombstone_s: {left[:5]}")
            records = getattr(ep.core, "records", None)
            if callable(records) and records() > 0:
                chk.fail("state_unbounded", f"{ep.name}: records()={records()} once quiet")
        self._epoch = _Epoch()
        self._quiescing = False
        if self.issued >= self.requests:
            self._done = True
            return
        self.sched.after(0.0, self._arrive)
        if self.faults.enabled & _PROCESS_FAULTS and self.faults.rate > 0:
            self.sched.after(self.rng.expovariate(self.faults.rate), self._process_fault)
        if self.faults.on("forge") and self.auth_key is not None:
            self.sched.after(self.rng.expovariate(self.faults.forge_rate), self._forge)
        if self.faults.on("twin") and self.faults.twin_rate > 0:
            self.sched.after(self.rng.expovariate(self.faults.twin_rate), self._twin)


# -- the real cores ------------------------------------------------------------------------
def default_producer(ep: Endpoint) -> Any:
    """The real :class:`~kvpush.protocol.producer.ProducerCore` with the run's timings."""
    from ..protocol.producer import CoreConfig, ProducerCore
    t = ep.sim.timings
    return ProducerCore(ep.layout, CoreConfig(lease_s=t.lease_s, max_wait_s=t.max_wait_s,
                                              transfer_timeout_s=t.transfer_timeout_s,
                                              tombstone_s=t.tombstone_s,
                                              peer_timeout_s=t.peer_timeout_s), ep.links)


def default_consumer(ep: Endpoint) -> Any:
    """The real :class:`~kvpush.protocol.consumer.ConsumerCore` with the run's timings (its
    own xids, if it draws any, come from the run's seed)."""
    from ..protocol.consumer import ConsumerCore, CoreConfig
    rng = ep.sim.rng
    t = ep.sim.timings
    return ConsumerCore(ep.layout, CoreConfig(abort_grace_s=t.abort_grace_s, verify=t.verify),
                        ep.links, stats=cast(Any, _CoreStats()),
                        xids=lambda: rng.getrandbits(63) | 1)


class _CoreStats:
    """Counters a core bumps (``stats.name += 1``): any name, starting at 0."""

    def __getattr__(self, name: str) -> int:
        if name.startswith("__"):
            raise AttributeError(name)
        return 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


# -- CLI -------------------------------------------------------------------------------------
def _load(spec: str | None) -> CoreFactory | None:
    """``module:func`` or ``path/to/file.py:func`` -> the function (None: the default)."""
    if spec is None:
        return None
    import importlib
    import importlib.util
    where, _, func = spec.rpartition(":")
    if not where or not func:
        raise SystemExit(f"--*-core takes MODULE:FUNC, got {spec!r}")
    if where.endswith(".py"):
        mspec = importlib.util.spec_from_file_location("_sim_cores", where)
        if mspec is None or mspec.loader is None:
            raise SystemExit(f"cannot load {where}")
        module = importlib.util.module_from_spec(mspec)
        sys.modules["_sim_cores"] = module
        mspec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    factory: CoreFactory = getattr(module, func)
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpush.testing.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--producers", type=int, default=2)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--faults", default="all",
                    help=f"comma-separated subset of {','.join(FAULTS)}, or all / none")
    ap.add_argument("--fault-rate", type=float, default=None,
                    help="process faults (cut/stall/kill) per simulated second")
    ap.add_argument("--rate", type=float, default=None, help="requests per simulated second")
    ap.add_argument("--epoch", type=int, default=2000,
                    help="requests between quiescence checks")
    ap.add_argument("--progress", type=int, default=0,
                    help="a progress line every N requests (default: N/10 for big runs)")
    ap.add_argument("--producer-core", default=None, metavar="MODULE:FUNC",
                    help="build producer cores with FUNC(endpoint) from MODULE (a dotted "
                         "name or a .py path); default: kvpush.protocol.producer")
    ap.add_argument("--consumer-core", default=None, metavar="MODULE:FUNC",
                    help="the same for consumer cores; default: kvpush.protocol.consumer")
    ap.add_argument("--tp", type=int, default=1,
                    help="producer ranks per request (tensor parallel: each holds one of "
                         "tp heads; consumers hold all)")
    ap.add_argument("--ctp", type=int, default=1,
                    help="consumer ranks per request, each taking its share of the heads "
                         "(sharers)")
    ap.add_argument("--kv-apart", action="store_true",
                    help="K and V of each layer in regions of their own (a layer-wise "
                         "push writes both regions of a layer per layer_done)")
    ap.add_argument("--verify", action="store_true",
                    help="per-block checksums with the data (ConsumerConfig.verify)")
    ap.add_argument("--transfer-timeout", type=float, default=None, metavar="S",
                    help="the producer's transfer_timeout_s (default 0.4, below "
                         "peer_timeout_s 1.0; the library's defaults and the soak's have it "
                         "above: a silent consumer is lost before its WRITE is abandoned)")
    ap.add_argument("--timings", choices=Timings.KINDS, default="sim",
                    help="the timeouts' order: the simulator's short ones (default), the "
                         "library's defaults scaled by 1/60 (peer < transfer < lease < "
                         "max_wait), or drawn from the seed")
    ap.add_argument("--auth", choices=("on", "off"), default="on",
                    help="authenticate every frame with a shared key (default), or not; "
                         "the forge fault needs a key")
    ap.add_argument("--stop-after", type=int, default=0, metavar="N",
                    help="stop at the N-th violation (default 0: run to the end)")
    ap.add_argument("--verbose", action="store_true", help="show the cores' log warnings")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="write every trace line to FILE (a violation prints only the tail)")
    args = ap.parse_args(argv)
    faults = Faults.parse(args.faults)
    if args.fault_rate is not None:
        faults = replace(faults, rate=args.fault_rate)
    progress = args.progress or (args.requests // 10 if args.requests >= 20_000 else 0)
    if args.tp < 1 or args.producers % args.tp or args.ctp < 1 or args.consumers % args.ctp:
        raise SystemExit("--producers must be a multiple of --tp, --consumers of --ctp")
    timings = Timings(verify=args.verify, tp=args.tp, ctp=args.ctp,
                      kv_apart=args.kv_apart).with_order(
        args.timings, args.seed)
    if args.transfer_timeout is not None:
        if not 0 < args.transfer_timeout < 60:
            raise SystemExit("--transfer-timeout takes seconds in (0, 60)")
        timings = replace(timings, transfer_timeout_s=args.transfer_timeout)
    if args.stop_after < 0:
        raise SystemExit("--stop-after takes a count >= 0")
    sim = Simulation(args.seed, producers=args.producers, consumers=args.consumers,
                     timings=timings,
                     requests=args.requests, rate=args.rate, faults=faults, epoch=args.epoch,
                     progress_every=progress, make_producer=_load(args.producer_core),
                     make_consumer=_load(args.consumer_core), stop_after=args.stop_after,
                     auth=args.auth == "on")
    with contextlib.ExitStack() as stack:
        if not args.verbose:  # the cores log every refused event; the checks say what matters
            kv = logging.getLogger("kvpush")
            stack.callback(kv.setLevel, kv.level)  # as found: main() may run in a process
            kv.setLevel(logging.ERROR)             # that goes on (a test's)
        if args.trace:
            sim.checker.keep = stack.enter_context(open(args.trace, "w", encoding="utf-8"))
        violations = sim.run()
    print(sim.details())
    if violations:
        print(f"replay: python -m kvpush.testing.sim --requests {args.requests} "
              f"--seed {args.seed} --producers {args.producers} --consumers {args.consumers} "
              f"--faults {args.faults}" + (f" --rate {args.rate}" if args.rate else "")
              + (f" --fault-rate {args.fault_rate}" if args.fault_rate is not None else "")
              + (" --verify" if args.verify else "")
              + (f" --tp {args.tp}" if args.tp > 1 else "")
              + (f" --ctp {args.ctp}" if args.ctp > 1 else "")
              + (f" --transfer-timeout {args.transfer_timeout}"
                 if args.transfer_timeout is not None else "")
              + (f" --timings {args.timings}" if args.timings != "sim" else "")
              + (" --auth off" if args.auth == "off" else ""))
    print(sim.summary())
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
