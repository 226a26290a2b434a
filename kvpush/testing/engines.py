"""Engine models: what a prefill and a decode engine do with their blocks, and the
invariants that follow from it.

The prefill engine writes a pattern unique to each (request, use) into its source blocks
before ``prefill_done`` and remembers the bytes as they were then; after a ``Release`` it
frees the blocks and reuses them at once (it overwrites them), so a transfer that still
reads them copies the reuse's bytes. The decode engine allocates destination blocks (filled
with its own pattern, so missing bytes show), checks every byte of a READY result against
its source's snapshot, frees the blocks on a safe result and quarantines them on an unsafe
one. Every byte that lands in a decode engine's memory is checked against who owns the
blocks it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import messages as m
from ..request import Release, RequestState, RequestStatus, TransferMode, TransferResult

if TYPE_CHECKING:
    from .driver import Endpoint
    from .fakes import Transfer
    from .sim import Simulation

__all__ = ["DecodeEngine", "PrefillEngine", "Request", "Source", "Use"]

_DECODE_TAG = 1 << 39      # decode-side fills (missing bytes show as these)
_REUSE_TAG = 1 << 38       # what a prefill engine writes into released blocks


@dataclass(eq=False)
class Request:
    """One use of a request id across the cluster: one source, one or more consumer uses."""

    rid: str
    number: int
    mode: TransferMode
    producer: str
    nblocks: int
    sharers: int = 1
    groups: int = 1               # push: 1, or one WRITE per layer (layer-wise)
    tail: int = 0                 # leading source blocks the consumers hold already
    producers: list[str] = field(default_factory=list)   # its producer ranks (TP)
    sources: list[Source] = field(default_factory=list)  # one per rank, in rank order
    open_sources: int = 0
    tickets: dict[str, Any] = field(default_factory=dict)  # pull: ranks' PullTickets so far
    uses: list[Use] = field(default_factory=list)
    producer_done: bool = False   # every source released, given back, or died
    open_uses: int = 0
    pending: int = 0              # engine calls scheduled and not yet made
    consumers: list[str] = field(default_factory=list)   # pull: who gets the ticket
    p_aborted: bool = False       # the prefill engine aborted it before prefill_done
    order: bool = False           # ...and still calls prefill_done, or aborts twice
    sids: dict[str, int] = field(default_factory=dict)   # source uses the router named
    retried: bool = False         # a consumer engine retried it (fault retry)
    finished: bool = False


@dataclass(eq=False)
class Source:
    req: Request
    ep: Endpoint
    ids: np.ndarray
    idset: frozenset[int]
    tag: int = 0                  # its bytes' pattern (unique per request use and rank)
    ended: bool = False
    sid: int = 0
    snapshot: np.ndarray | None = None
    done_at: float = -1.0
    released: bool = False
    #: xid -> time until which the producer promised (PullHeld) to hold the blocks
    held_until: dict[int, float] = field(default_factory=dict)
    layers_written: set[int] = field(default_factory=set)
    handed: bool = False          # given to kvpush (layer_done or prefill_done)
    engine_done: bool = False     # the engine writes no more into them (done or aborted)
    released_by: Endpoint | None = None
    released_at: float = -1.0     # when the engine took the release (-1: not yet)
    quarantine_until: float = 0.0   # Release.blocks_safe False: unchanged until then
    #: the Claims the producer core took of it, by (consumer, xid): [when it took it, when
    #: the consumer gave the claim up or continued it (-1: neither yet)]
    claims: dict[tuple[str, int], list[float]] = field(default_factory=dict)


@dataclass(eq=False)
class Use:
    req: Request
    ep: Endpoint
    ids: np.ndarray
    xid: int = 0
    started: float = 0.0
    deadline: float = 0.0
    stall0: float = 0.0
    result: TransferResult | None = None
    moving: int = 0               # transfers of this use still moving bytes
    quarantine_until: float = -1.0


class PrefillEngine:
    """The prefill side's block pool and sources."""

    def __init__(self, sim: Simulation, ep: Endpoint) -> None:
        self.sim = sim
        self.ep = ep
        self.dead = False
        ep.memory.owner = self
        self.free: list[int] = list(range(ep.memory.num_blocks))
        self.sources: dict[str, Source] = {}
        #: block id -> the live source holding it
        self.owner: dict[int, Source] = {}
        #: push Claims the producer core took for the next use of an id (its source not
        #: allocated yet, or the current one released): the next source's claims
        self.pending_claims: dict[str, dict[tuple[str, int], list[float]]] = {}

    def allocate(self, req: Request) -> Source | None:
        if len(self.free) < req.nblocks or req.rid in self.sources:
            return None
        rng = self.sim.sched.rng
        ids = [self.free.pop(rng.randrange(len(self.free))) for _ in range(req.nblocks)]
        arr = np.array(ids, dtype=np.int64)
        src = Source(req, self.ep, arr, frozenset(ids), tag=req.number * 64 + len(req.sources))
        src.claims = self.pending_claims.pop(req.rid, {})
        self.sources[req.rid] = src
        for b in ids:
            self.owner[b] = src
        return src

    def give_back(self, src: Source) -> None:
        """The engine frees blocks it never handed to kvpush (aborted before prefill)."""
        self._free(src)

    def _free(self, src: Source) -> None:
        wait = src.quarantine_until - self.sim.sched.now
        if wait > 0:      # kept unchanged until then (a transfer may still read them)
            self.sim.sched.after(wait, self._free, src)
            return
        if self.dead:
            return
        if self.sources.get(src.req.rid) is src:
            del self.sources[src.req.rid]
        for b in src.ids.tolist():
            if self.owner.get(b) is src:
                del self.owner[b]
            else:   # the model's own bookkeeping is wrong: say so, loudly
                self.sim.checker.fail("sim_model", f"{self.ep.name}: block {b} of "
                                      f"{src.req.rid!r} freed twice")
                return
        self.sim.reuse_tag += 1
        self.ep.memory.fill(src.ids, _REUSE_TAG | self.sim.reuse_tag)  # reused at once
        self.free.extend(src.ids.tolist())

    def layer_done(self, src: Source, layer: int) -> None:
        """Layer ``layer`` (its region, or its K and V regions) is final: the engine wrote
        it."""
        for region in self.ep.memory.layer_regions(layer):
            self.ep.memory.fill(src.ids, src.tag, region=region)
        src.layers_written.add(layer)
        src.handed = True

    def prefill_done(self, src: Source) -> None:
        mem = self.ep.memory
        for r in range(mem.num_regions):
            if r // mem.regions_per_layer not in src.layers_written:
                mem.fill(src.ids, src.tag, region=r)
        src.snapshot = mem.snapshot(src.ids)
        src.done_at = self.sim.sched.now
        src.handed = True
        src.engine_done = True

    def on_release(self, rel: Release) -> None:
        chk = self.sim.checker
        src = self.sources.get(rel.request_id)
        if src is None or src.released or not src.handed:
            chk.fail("release_not_held",
                     f"{self.ep.name} released {rel.request_id!r} ({rel.reason.value}) "
                     f"but holds no source of it (a second release?)")
            return
        if sorted(np.asarray(rel.block_ids).tolist()) != sorted(src.ids.tolist()):
            chk.fail("release_wrong_blocks",
                     f"{self.ep.name} released {rel.request_id!r} naming blocks "
                     f"{np.asarray(rel.block_ids).tolist()}, held {src.ids.tolist()}")
        now = self.sim.sched.now
        safe = getattr(rel, "blocks_safe", True)
        for xfer in self.sim.posted_from(self.ep.memory) if safe else ():
            if xfer.op == "WRITE" \
                    and not src.idset.isdisjoint(xfer.src_blocks):
                chk.fail("release_while_writing",
                         f"{self.ep.name} released {rel.request_id!r} ({rel.reason.value}) "
                         f"while its WRITE {xfer.key} to {xfer.consumer} "
                         f"(xid {xfer.xid:x}) had not ended")
        for xfer in self.sim.nixl.reading(self.ep.memory) if safe else ():
            until = src.held_until.get(xfer.xid)
            use = xfer.use
            # (a READ whose use already ended, or whose consumer died, is trusted by no one)
            trusted = use is not None and use.result is None and not use.ep.engine.dead
            if xfer.op == "READ" and until is not None and now < until and trusted \
                    and not src.idset.isdisjoint(xfer.src_blocks):
                chk.fail("release_while_held",
                         f"{self.ep.name} released {rel.request_id!r} ({rel.reason.value}) "
                         f"while {xfer.consumer}'s READ (xid {xfer.xid:x}) was in flight "
                         f"under its PullHeld promise (until t={until:.6f})")
        src.released = True
        src.released_by = self.ep
        src.released_at = now
        self.sim.checker.trace(f"{self.ep.name} release {rel.request_id} {rel.reason.value}")
        if not safe:
            # "a transfer may still read these blocks": they stay unchanged for the
            # Release's quarantine_s, then go back to the pool
            self.sim.stats["releases_unsafe"] += 1
            src.quarantine_until = now + rel.quarantine_s
        if not src.engine_done:
            return   # layer-wise, before prefill_done: the engine frees them once it is done
        self._free(src)
        self.sim.source_ended(src)

    def check_write(self, xfer: Transfer) -> None:
        """A WRITE may only read blocks of a source this engine has handed to kvpush and
        not had back, and (layer-wise) only layers the engine said are final."""
        nb = self.ep.memory.num_blocks
        for row in xfer.src_rows.tolist():
            b, region = row % nb, row // nb
            layer = region // self.ep.memory.regions_per_layer
            src = self.owner.get(b)
            if src is None or not src.handed or src.released:
                self.sim.checker.fail(
                    "write_from_unheld",
                    f"{self.ep.name} posted WRITE {xfer.key} to {xfer.consumer} "
                    f"(xid {xfer.xid:x}) reading block {b}, which no source held by kvpush "
                    f"holds")
                return
            if src.done_at < 0 and layer not in src.layers_written:
                self.sim.checker.fail(
                    "write_before_final",
                    f"{self.ep.name} posted WRITE {xfer.key} to {xfer.consumer} "
                    f"(xid {xfer.xid:x}) reading region {region} (layer {layer}) of "
                    f"{src.req.rid!r} before the engine said it is final")
                return

    def died(self) -> None:
        self.dead = True
        for src in list(self.sources.values()):
            self.sim.source_ended(src)
        self.sources.clear()
        self.pending_claims.clear()

    def took_claim(self, now: float, consumer: str, msg: m.Claim,
                   status: RequestStatus) -> None:
        """The producer core was handed ``msg`` from ``consumer`` just now and is at
        ``status`` for its request since. A pull claim holds the live source its ``sid``
        names. A push claim the core made an owner of holds the live source, unless the
        core is waiting for a prefill_done while that source was already handed to it:
        the core released that use (the engine hears of it after this) and took the claim
        again for the next use, which holds it. A push claim the core did not make an
        owner (refused, or waiting for the held use's release) holds nothing yet."""
        src = self.sources.get(msg.request_id)
        key = (consumer, msg.xid)
        if not msg.push:
            if src is not None and not src.released and msg.sid == src.sid:
                src.claims[key] = [now, -1.0]
            return
        if not any((o.peer, o.xid) == key for o in status.owners):
            return
        if src is not None and not src.released \
                and (status.phase != "waiting" or not src.handed):
            src.claims[key] = [now, -1.0]
        else:
            self.pending_claims.setdefault(msg.request_id, {})[key] = [now, -1.0]

    def claim_gone(self, now: float, consumer: str, rid: str, xid: int) -> None:
        """``consumer`` gave its claim ``xid`` of ``rid`` up just now (its ``ClaimGone``),
        or continued it (this producer took its ``Register`` or ``PullBegin``): the claim
        holds the source no more; the transfer that continues it is bounded as any is."""
        key = (consumer, xid)
        src = self.sources.get(rid)
        for claims in (src.claims if src is not None else {}, self.pending_claims.get(rid, {})):
            if key in claims and claims[key][1] < 0:
                claims[key][1] = now


class DecodeEngine:
    """The decode side's block pool and request uses."""

    def __init__(self, sim: Simulation, ep: Endpoint) -> None:
        self.sim = sim
        self.ep = ep
        self.dead = False
        ep.memory.owner = self
        self.free: list[int] = list(range(ep.memory.num_blocks))
        self.uses: dict[int, Use] = {}          # by xid, until its result
        self.by_rid: dict[str, Use] = {}
        #: block id -> xid of the use whose bytes may land there (0: nobody's)
        self.owner = [0] * ep.memory.num_blocks
        self.quarantined: list[Use] = []
        self.done: dict[int, Use] = {}          # xid -> use with a result, transfers moving
        # Engine calls queued to a (stalled) loop. A dict as an ordered set: uses hash by
        # identity, so a set would iterate in address order and a death would end them in
        # an order that differs from run to run (the same seed's traces diverged).
        self.calling: dict[Use, None] = {}

    def allocate(self, req: Request) -> Use | None:
        n = req.nblocks - req.tail        # a prefix hit holds the first req.tail already
        if len(self.free) < n or req.rid in self.by_rid:
            return None
        rng = self.sim.sched.rng
        ids = [self.free.pop(rng.randrange(len(self.free))) for _ in range(n)]
        arr = np.array(ids, dtype=np.int64)
        self.sim.reuse_tag += 1
        self.ep.memory.fill(arr, _DECODE_TAG | self.sim.reuse_tag)
        use = Use(req, self.ep, arr)
        return use

    def started(self, use: Use, xid: int) -> None:
        use.xid = xid
        if xid in self.uses or xid in self.done:
            self.sim.checker.fail("xid_reused", f"{self.ep.name} got xid {xid:x} twice")
        self.uses[xid] = use
        self.by_rid[use.req.rid] = use
        for b in use.ids.tolist():
            self.owner[b] = xid

    def cancel(self, use: Use) -> None:
        """The call that would have started ``use`` raised: the engine keeps its blocks."""
        self.free.extend(use.ids.tolist())

    def on_result(self, res: TransferResult) -> None:
        chk = self.sim.checker
        xid = getattr(res, "xid", 0)
        use = self.uses.get(xid) if xid else self.by_rid.get(res.request_id)
        if use is None or use.req.rid != res.request_id:
            prior = self.done.get(xid) if xid else None
            what = "a second result" if prior is not None else "a result of no live use"
            chk.fail("result_not_once",
                     f"{self.ep.name}: {what} for {res.request_id!r} xid {xid:x} "
                     f"({res.state.value})")
            return
        now = self.sim.sched.now
        use.result = res
        del self.uses[use.xid]
        if self.by_rid.get(use.req.rid) is use:
            del self.by_rid[use.req.rid]
        chk.trace(f"{self.ep.name} result {res.request_id} xid={use.xid:x} {res.state.value} "
                  f"safe={res.blocks_safe}")
        ids = getattr(res, "block_ids", None)
        if ids is not None and sorted(np.asarray(ids).tolist()) != sorted(use.ids.tolist()):
            chk.fail("result_wrong_blocks",
                     f"{self.ep.name}: result of {res.request_id!r} names blocks "
                     f"{np.asarray(ids).tolist()}, the use has {use.ids.tolist()}")
        if res.state is RequestState.READY:
            self._check_ready(use, res)
            if use.req.tail:
                self.sim.stats["ready_prefix_hits"] += 1
            if use.req.groups > 1:
                self.sim.stats["ready_layerwise"] += 1
        self.sim.stats["results_" + res.state.value] += 1
        if res.blocks_safe:
            self._free(use)
        else:
            self.sim.stats["results_unsafe"] += 1
            use.quarantine_until = now + self.sim.timings.quarantine_s
            self.quarantined.append(use)
        if use.moving:
            self.done[use.xid] = use
        self.sim.consumer_ended(use)

    def _check_ready(self, use: Use, res: TransferResult) -> None:
        chk = self.sim.checker
        mem = self.ep.memory
        whole = mem.snapshot(use.ids)
        if not use.req.sources:           # its prefill has not even started
            chk.fail("ready_without_source",
                     f"{self.ep.name}: {use.req.rid!r} (xid {use.xid:x}) READY before its "
                     f"prefill engine took it (another use's bytes)")
            return
        for src in use.req.sources:       # each rank's heads, from its source
            off, src_off, n = mem.overlap(src.ep.memory)
            if n == 0:
                continue                  # a rank holding none of this consumer's heads
            if src.snapshot is None:
                chk.fail("ready_without_source",
                         f"{self.ep.name}: {use.req.rid!r} READY but the prefill of "
                         f"{src.ep.name} never finished")
                return
            got = whole[:, off // 8:(off + n) // 8]
            snap = src.snapshot
            if use.req.tail:                  # the source's last len(use.ids) blocks
                regions = mem.num_regions
                snap = snap.reshape(regions, -1, snap.shape[1])[:, use.req.tail:, :] \
                    .reshape(-1, snap.shape[1])
            want = snap[:, src_off // 8:(src_off + n) // 8]
            if np.array_equal(got, want):
                continue
            rows = np.nonzero((got != want).any(axis=1))[0]
            bad = sorted({int(r) % len(use.ids) for r in rows})
            # which use's bytes sit in each wrong (region, block)
            found = ", ".join(sorted({_describe(int(w) >> 24) for w in got[rows, 0]}))
            chk.fail("ready_wrong_bytes",
                     f"{self.ep.name}: {use.req.rid!r} (xid {use.xid:x}, {use.req.mode.value}"
                     f" from {src.ep.name}) READY with {len(bad)} of {len(use.ids)} "
                     f"blocks not equal to the source at prefill_done (use "
                     f"{src.tag}); found: {found}")
            return

    def _free(self, use: Use) -> None:
        for b in use.ids.tolist():
            if self.owner[b] == use.xid:
                self.owner[b] = 0
        self.free.extend(use.ids.tolist())

    def release_quarantine(self) -> None:
        now = self.sim.sched.now
        keep = []
        for use in self.quarantined:
            if use.moving == 0 and now >= use.quarantine_until:
                self._free(use)
            else:
                keep.append(use)
        self.quarantined = keep

    def on_landing(self, xfer: Transfer, lo: int, hi: int) -> None:
        """Bytes of ``xfer`` just landed in this engine's memory."""
        if xfer.flagged:
            return      # reported once per transfer
        nb = self.ep.memory.num_blocks
        for row in xfer.dst_rows[lo:hi].tolist():
            b = row % nb
            if self.owner[b] != xfer.xid:
                use = self.done.get(xfer.xid)
                how = (f"after its {use.result.state.value} result with blocks_safe=True"
                       if use is not None and use.result is not None else
                       "into blocks it does not own")
                self.sim.checker.fail(
                    "landed_after_safe",
                    f"{xfer.op} {xfer.key} of {xfer.consumer} xid {xfer.xid:x} wrote block "
                    f"{b} {how} (block now owned by xid {self.owner[b]:x})")
                xfer.flagged = True
                return

    def transfer_stopped(self, use: Use) -> None:
        if use.moving == 0 and use.result is not None:
            self.done.pop(use.xid, None)

    def died(self) -> None:
        self.dead = True
        for use in [*self.uses.values(), *self.calling]:
            self.sim.consumer_ended(use)
        self.uses.clear()
        self.calling.clear()
        self.by_rid.clear()


def _describe(tag: int) -> str:
    if tag & _DECODE_TAG:
        return "the decode engine's own fill (bytes never landed)"
    if tag & _REUSE_TAG:
        return "bytes of a released block's reuse"
    return f"bytes of request use {tag}"

