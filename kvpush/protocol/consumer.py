"""The decode side's protocol core: what a Consumer does with each request, without I/O.

One record per request use (``request_id`` + the ``xid`` this side chose), a claim not
begun included, in an explicit :class:`Phase`, and one transition table, :data:`TABLE`
(:mod:`kvpush.protocol.table`): for every phase, the events allowed in it, what each does
and the phases it may lead to, checked after each. An event that the table does not allow
in the request's phase changes nothing; it is counted (``stats.events_refused``) and
logged. A message whose ``(request_id, xid)`` names no live use is counted as
``stale_messages``. The phases and what ends a request: ``docs/PROTOCOL.md``; the diagram,
generated from the table: ``docs/ARCHITECTURE.md``.

The driver (:class:`kvpush.Consumer`) owns sockets, the NIXL agent, the handshake,
authentication and heartbeats; it feeds events in with its ``now`` (monotonic seconds) and
carries out the effects of :meth:`ConsumerCore.drain` (:mod:`kvpush.protocol.effects`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import _core
from .. import messages as m
from .._enum import IdentityEnum
from ..errors import (
    ClosedError,
    InvalidBlockIds,
    InvalidRequest,
    KvpushError,
    PeerUnavailable,
    RequestAborted,
    TransferFailed,
    TransferTimeout,
)
from ..layout import KVLayout
from ..metrics import LIVE, Stats
from ..request import RequestState, RequestStatus, TransferMode, TransferResult
from .effects import Abandon, ClaimGone, Dial, Effect, Emit, Post, Send, XferEnd
from .landings import Landings, PostTimes
from .table import Table, row
from .timers import Timer, TimerHeap

__all__ = ["TABLE", "ConsumerCore", "CoreConfig", "Event", "Links", "Phase", "Settings",
           "new_xid", "pull_length_error"]

log = logging.getLogger("kvpush.consumer")


def new_xid() -> int:
    """A fresh transfer id (see :mod:`kvpush.messages`): random, 63 bits, never 0."""
    return int.from_bytes(os.urandom(8), "big") >> 1 | 1


class Phase(IdentityEnum):
    """Where a request use is. A use that has its result (or a claim given up) is DONE, and
    its record is gone."""

    CLAIMING = "claiming"          # pull later: its Claim waits for its producers' handshakes
    CLAIMED = "claimed"            # claimed (pull later, or push later): not begun
    CONNECTING = "connecting"      # pull: the driver connects to its producers first
    PUSHING = "pushing"            # registered; waiting for every part's Landed
    PULLING = "pulling"            # READs posted; waiting for their end and PullHeld
    PUSH_CLOSING = "push_closing"  # ending without success; waiting until nothing lands
    PULL_CLOSING = "pull_closing"  # ending without success; waiting for the READs' end
    DONE = "done"                  # reported (or the claim given up): the record is gone


class Event(IdentityEnum):
    POSTED = "posted"              # Posted: a part's WRITE is being posted
    LANDED = "landed"              # Landed notification (or Posted.empty)
    FAILED = "failed"              # Failed from a producer
    ABORT_ACK = "abort_ack"        # AbortAck: the producer's WRITEs have ended
    PEER_ABORT = "peer_abort"      # Abort from a producer
    PULL_HELD = "pull_held"        # PullHeld: the producer holds the source
    READ_ENDED = "read_ended"      # the driver: a READ ended (done, error, abandoned)
    DEADLINE = "deadline"          # the request's own timeout
    ABORT = "abort"                # the engine gave the request up
    PEER_LOST = "peer_lost"        # a producer of the request is gone
    GRACE_OVER = "grace_over"      # abort_grace_s after the close began
    CLOSE = "close"                # the consumer closes
    EXPECT = "expect"              # the engine's expect continues a push claim
    PULL = "pull"                  # the engine's pull continues a claim or a connecting use
    CONNECT_FAILED = "connect_failed"  # dialed(): a handshake failed, or the wrong producer
    CONNECTED = "connected"        # dialed(): every producer of a claiming use is up


#: Graces a closing use waits for NIXL to let go of its READs (each asks it again) before
#: it ends without them, unsafe.
GRACE_ROUNDS = 3

P, E = Phase, Event
_PUSH_END = (P.PUSH_CLOSING, P.DONE)
_PULL_END = (P.PULL_CLOSING, P.DONE)
#: The request machine (:mod:`kvpush.protocol.table`): for each phase, the events allowed in
#: it, the method of ConsumerCore that runs each (none: allowed, and changes nothing, e.g. a
#: second abort of a closing use) and the phases it may lead to.
TABLE: Table[Phase, Event] = Table("consumer request", {
    P.CLAIMING: {
        # connected: the Claim goes to every producer
        E.CONNECTED: row("_claim_connected", P.CLAIMED),
        # given up, no result (a claim has no handle): a handshake failed or reached another
        # producer, the dial time or the tickets' lease ran out, a producer is lost, the
        # engine aborts, its pull comes first (and connects as a pull of its own), close
        E.CONNECT_FAILED: row("_claim_failed", P.DONE), E.DEADLINE: row("_claim_failed", P.DONE),
        E.PEER_LOST: row("_end_claim", P.DONE), E.ABORT: row("_end_claim", P.DONE),
        E.PULL: row("_end_claim", P.DONE), E.CLOSE: row("_end_claim", P.DONE),
    },
    P.CLAIMED: {
        E.EXPECT: row("_continue_claim", P.PUSHING), E.PULL: row("_continue_claim", P.PULLING),
        # the producer refused or gave up the claim, or is lost; the engine aborts; close
        E.FAILED: row("_end_claim", P.DONE), E.PEER_ABORT: row("_end_claim", P.DONE),
        E.PEER_LOST: row("_end_claim", P.DONE), E.ABORT: row("_end_claim", P.DONE),
        E.CLOSE: row("_end_claim", P.DONE),
    },
    P.CONNECTING: {
        # connected: the pull begins (a record of its own, under this xid)
        E.PULL: row("_connected", P.PULLING),
        # reported at once: nothing was posted, its blocks are safe
        E.CONNECT_FAILED: row("_end_unstarted", P.DONE), E.ABORT: row("_end_unstarted", P.DONE),
        E.CLOSE: row("_end_unstarted", P.DONE),
    },
    P.PUSHING: {
        E.POSTED: row("_on_posted", P.PUSHING),
        E.LANDED: row("_on_landed", P.PUSHING, *_PUSH_END),
        E.FAILED: row("_on_failed", *_PUSH_END), E.PEER_ABORT: row("_on_peer_abort", *_PUSH_END),
        E.DEADLINE: row("_on_deadline", *_PUSH_END), E.ABORT: row("_on_abort", *_PUSH_END),
        E.PEER_LOST: row("_on_peer_lost", *_PUSH_END), E.CLOSE: row("_on_close", *_PUSH_END),
    },
    P.PUSH_CLOSING: {
        # A WRITE posted before our Abort reached the producer is announced late: wait
        # for its Landed too.
        E.POSTED: row("_on_posted", P.PUSH_CLOSING), E.LANDED: row("_on_landed", *_PUSH_END),
        E.FAILED: row("_on_ack", *_PUSH_END), E.ABORT_ACK: row("_on_ack", *_PUSH_END),
        E.PEER_ABORT: row(None, P.PUSH_CLOSING), E.ABORT: row(None, P.PUSH_CLOSING),
        E.PEER_LOST: row("_on_peer_lost", *_PUSH_END),
        E.GRACE_OVER: row("_on_grace_over", *_PUSH_END), E.CLOSE: row("_on_close", *_PUSH_END),
    },
    P.PULLING: {
        E.PULL_HELD: row("_on_held", P.PULLING, *_PULL_END),
        E.READ_ENDED: row("_on_read_ended", P.PULLING, *_PULL_END),
        E.FAILED: row("_on_failed", *_PULL_END), E.PEER_ABORT: row("_on_peer_abort", *_PULL_END),
        E.DEADLINE: row("_on_deadline", *_PULL_END), E.ABORT: row("_on_abort", *_PULL_END),
        E.PEER_LOST: row("_on_peer_lost", *_PULL_END), E.CLOSE: row("_on_close", *_PULL_END),
    },
    P.PULL_CLOSING: {
        # The producer's answers to our PullBegin or Abort may still come: nothing to do.
        E.PULL_HELD: row(None, P.PULL_CLOSING), E.FAILED: row(None, P.PULL_CLOSING),
        E.ABORT_ACK: row(None, P.PULL_CLOSING), E.PEER_ABORT: row(None, P.PULL_CLOSING),
        E.ABORT: row(None, P.PULL_CLOSING),
        E.READ_ENDED: row("_on_read_ended", *_PULL_END),
        E.PEER_LOST: row("_on_peer_lost", *_PULL_END),
        E.GRACE_OVER: row("_on_grace_over", *_PULL_END), E.CLOSE: row("_on_close", *_PULL_END),
    },
}, initial=[P.CLAIMING, P.CLAIMED, P.CONNECTING, P.PUSHING, P.PULLING], final=[P.DONE])
del P, E, _PUSH_END, _PULL_END

_CLOSING = {Phase.PUSHING: Phase.PUSH_CLOSING, Phase.PULLING: Phase.PULL_CLOSING,
            Phase.PUSH_CLOSING: Phase.PUSH_CLOSING, Phase.PULL_CLOSING: Phase.PULL_CLOSING}

_FAILED_CODES: dict[str, tuple[RequestState, type[KvpushError]]] = {
    "aborted": (RequestState.ABORTED, RequestAborted),
    "timeout": (RequestState.TIMED_OUT, TransferTimeout),
    "lease_expired": (RequestState.TIMED_OUT, TransferTimeout),
}

_COUNTERS = {
    RequestState.READY: "requests_completed",
    RequestState.FAILED: "requests_failed",
    RequestState.TIMED_OUT: "requests_timed_out",
    RequestState.ABORTED: "requests_aborted",
}


class Links(Protocol):
    """What the core needs of the prepared descriptor lists (pure, no I/O)."""

    def plan(self, peer: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             coalesce: bool) -> Any:
        """The compiled core's plan of moving ``remote_ids`` of ``peer`` into
        ``local_ids`` (``local_indices``, ``remote_indices``, ``num_blocks``,
        ``num_descriptors``); raises a KvpushError for ids it cannot pair."""

    def desc_bytes(self, peer: str) -> int:
        """Bytes one descriptor of ``peer``'s link moves."""

    def checksums(self, ids: np.ndarray) -> np.ndarray | bytes:
        """Per-block 64-bit checksums of this side's blocks ``ids`` (uint64 array, or
        little-endian bytes)."""


class Settings(Protocol):
    """What the core reads of its configuration (:class:`CoreConfig`, or a
    :class:`kvpush.ConsumerConfig` itself)."""

    @property
    def abort_grace_s(self) -> float: ...
    @property
    def verify(self) -> bool: ...
    @property
    def coalesce(self) -> bool: ...


@dataclass(frozen=True)
class CoreConfig:
    """The settings of :class:`kvpush.ConsumerConfig` that the core reads."""

    abort_grace_s: float = 5.0
    verify: bool = False
    coalesce: bool = True


@dataclass
class _Read:
    peer: str
    nbytes: int
    abandoning: bool = False      # Abandon asked; the driver's transfer_ended follows


@dataclass
class _Request:
    """One live use of a request id on this side."""

    rid: str
    xid: int
    mode: TransferMode
    phase: Phase
    ids: np.ndarray
    producers: list[str]          # agent names, index = part // groups
    started: float
    deadline: float
    groups: int = 1               # parts per producer (1, or one per layer)
    landed: set[int] = field(default_factory=set)    # parts whose data landed
    settled: set[int] = field(default_factory=set)   # parts that will write nothing more
    posted: dict[int, float] = field(default_factory=dict)  # announced, not landed: when
    inline: dict[int, float] = field(default_factory=dict)  # of those: Posted.inline_s
    fence: set[int] = field(default_factory=set)     # closing: posted parts whose Landed must come
    waiting_acks: set[str] = field(default_factory=set)  # closing push: producers to confirm
    asked: bool = False           # Abort sent to the producers
    moved: int = 0                # bytes moved into the destination so far
    end: RequestState | None = None       # closing: the state it will be reported in
    error: KvpushError | None = None
    grace: float | None = None    # closing: when abort_grace_s runs out
    graces: int = 0               # closing: graces run out so far (see _on_grace_over)
    unsafe: bool = False          # a transfer may still land: blocks_safe=False
    checksums: bytes | None = None        # pull with verify: the ticket's source checksums
    # pull
    sids: dict[str, int] = field(default_factory=dict)      # producer -> source use
    sharers: dict[str, int] = field(default_factory=dict)   # pull: per producer, as sent
    reads: dict[int, _Read] = field(default_factory=dict)   # transfer key -> READ
    unheld: set[str] = field(default_factory=set)           # producers yet to send PullHeld
    began: dict[str, float] = field(default_factory=dict)   # PullBegin sent at
    held_until: dict[str, float] = field(default_factory=dict)  # began + hold_s
    read_end: dict[str, float] = field(default_factory=dict)    # READ seen ended at
    # connecting (claiming): the pull to begin once every producer is connected, and the
    # tickets of those still being dialled, by address
    dialing: dict[str, m.PullTicket] = field(default_factory=dict)
    begin: tuple[Any, ...] = ()
    lease_end: float = math.inf   # claiming: when the tickets' leases run out
    timer: Timer | None = None    # its one armed timer: the deadline, or closing, the grace

    @property
    def parts(self) -> int:
        return len(self.producers) * self.groups

    def producer_of(self, part: int) -> str:
        return self.producers[part // self.groups]

    def parts_of(self, name: str) -> range:
        p = self.producers.index(name)
        return range(p * self.groups, (p + 1) * self.groups)

    def settled_producer(self, name: str) -> bool:
        return all(part in self.settled for part in self.parts_of(name))


def _per_ticket(tickets: Sequence[m.PullTicket], sharers: int | Sequence[int]) -> dict[str, int]:
    """``sharers`` (one count for all, or one per ticket) by producer name."""
    counts = [sharers] * len(tickets) if isinstance(sharers, int) else list(sharers)
    if len(counts) != len(tickets):
        raise ValueError(f"sharers names {len(counts)} counts for {len(tickets)} tickets")
    return {t.producer: n for t, n in zip(tickets, counts, strict=True)}


def _dial_error(t: m.PullTicket, name: str | None,
                error: KvpushError | None) -> KvpushError | None:
    """Why the Dial of ticket ``t``'s address, answered ``name``/``error``, did not connect
    its producer (None: it did)."""
    if error is None and name != t.producer:
        return PeerUnavailable(f"{t.address} is {name!r}, the ticket names {t.producer!r}")
    return error


def pull_length_error(t: m.PullTicket, src: np.ndarray, dst: np.ndarray, ours: KVLayout,
                      theirs: KVLayout | None) -> InvalidBlockIds | None:
    """Whether ticket ``t``'s source blocks ``src`` and ``dst`` differ in number where the
    producer's blocks hold as many tokens as this side's (``theirs`` None: not known yet,
    taken as the same)."""
    if theirs is not None and theirs.tokens_per_block != ours.tokens_per_block:
        return None
    if len(src) != len(dst):
        return InvalidBlockIds(f"the ticket of {t.producer} names {len(src)} source "
                               f"blocks but block_ids has {len(dst)}")
    return None


class ConsumerCore:
    """The decode side's per-request state machines (see the module docstring).

    Parameters
    ----------
    layout
        This side's KV cache (for the size classes of landing predictions).
    config
        :class:`CoreConfig` (or a :class:`kvpush.ConsumerConfig`).
    links
        :class:`Links` over the driver's prepared descriptor lists.
    stats
        Where to count (the driver's :class:`~kvpush.metrics.Stats`, shared).
    xids
        Where transfer ids come from when a call does not bring its own (a simulator
        passes a seeded generator, so a run replays exactly).
    """

    def __init__(self, layout: KVLayout, config: Settings, links: Links,
                 stats: Stats | None = None, xids: Callable[[], int] = new_xid) -> None:
        self._new_xid = xids
        self.layout = layout
        self.config = config
        self.links = links
        self.stats = stats if stats is not None else Stats()
        self.gauges: dict[str, int] = {}   # none: the driver publishes what a core keeps
        self._out: list[Effect] = []
        self._peers: set[str] = set()
        self._layouts: dict[str, KVLayout] = {}    # each connected producer's, as announced
        self._requests: dict[str, _Request] = {}
        self._claims: dict[str, _Request] = {}     # CLAIMING and CLAIMED uses, by id
        self._completions = _core.CompletionTable()
        self._keys = itertools.count(1)
        self._read_of: dict[int, str] = {}          # transfer key -> request id
        # each live use's one armed timer (the deadline, or closing, its grace)
        self._timers = TimerHeap()
        # Seconds from a push part's Posted hint to its landing, by size class (bit length
        # of its bytes): when the driver should poll for the next landing.
        self._landings = Landings()
        # How long READs from each producer take when they end inside their post, by size
        # class: PullBegin.inline_s.
        self._inline = PostTimes()
        self._posting: dict[str, _Request] = {}     # push parts announced and not landed
        # Claims given up whose producer has not acknowledged our Abort yet, by (producer,
        # request id, xid): the timer that says it again.
        self._unacked: dict[tuple[str, str, int], Timer] = {}

    # -- outputs -----------------------------------------------------------------------
    def drain(self) -> list[Effect]:
        out, self._out = self._out, []
        return out

    def status(self, rid: str) -> str:
        """The phase of ``rid``'s live use, its claim's (``"claiming"``, ``"claimed"``), or
        ``"none"``."""
        req = self._requests.get(rid) or self._claims.get(rid)
        return "none" if req is None else req.phase.value

    def snapshot(self, rid: str) -> RequestStatus:
        """``rid``'s live use here, as a typed snapshot (see :class:`kvpush.RequestStatus`)."""
        req = self._requests.get(rid)
        if req is None:
            claim = self._claims.get(rid)
            if claim is None:
                return RequestStatus(rid, "none")
            return RequestStatus(rid, claim.phase.value, claim.mode, claim.xid,
                                 next(iter(claim.sids.values())) if len(claim.sids) == 1
                                 else 0, parts=len(claim.sids),
                                 deadline=None if claim.deadline == math.inf else claim.deadline)
        if req.phase is Phase.CONNECTING:
            return RequestStatus(rid, "connecting", req.mode, req.xid, 0, req.ids,
                                 deadline=req.deadline)
        closing = req.phase in (Phase.PUSH_CLOSING, Phase.PULL_CLOSING)
        return RequestStatus(
            rid, req.phase.value, req.mode, req.xid,
            next(iter(req.sids.values())) if len(req.sids) == 1 else 0, req.ids, req.parts,
            len(req.landed), req.grace if closing and req.grace is not None else req.deadline,
            req.moved)

    def xid_of(self, rid: str) -> int | None:
        req = self._requests.get(rid)
        return None if req is None else req.xid

    @property
    def pending(self) -> int:
        return len(self._requests)

    def in_flight(self) -> int:
        """READs posted whose end the driver has not reported."""
        return len(self._read_of)

    def wants_notifications(self) -> bool:
        """True while a push part is announced in flight: the driver reads NIXL's
        notifications."""
        return bool(self._posting)

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def _waits(self) -> Iterator[tuple[int, float, float]]:
        """(size class, hinted at, Posted.inline_s) of every announced push part still to
        land."""
        for req in self._posting.values():
            size = self._size_class(req)
            for part, hinted in req.posted.items():
                yield size, hinted, req.inline.get(part, 0.0)

    def quiet_until(self, now: float) -> float | None:
        """Until when the driver need not poll NIXL for this side's notifications (see
        :meth:`Landings.quiet_until`: every announced part came ``inline_s``)."""
        return self._landings.quiet_until(now, self._waits())

    def predicted(self, now: float, spin_s: float) -> tuple[float, float] | None:
        """The earliest predicted landing of an announced push part still to come: from
        the smoothed hint-to-landing time of its size class, to be polled closely for a
        quarter of that time (at least ``spin_s``)."""
        return self._landings.window(now, spin_s, self._waits())

    # -- peers -------------------------------------------------------------------------
    def peer_up(self, now: float, peer: str, layout: KVLayout | None = None) -> None:
        self._peers.add(peer)
        if layout is not None:
            self._layouts[peer] = layout

    def peer_lost(self, now: float, peer: str, why: str) -> None:
        """``peer`` is gone (silent, Bye, NIXL disconnect, restarted elsewhere)."""
        self._peers.discard(peer)
        self._layouts.pop(peer, None)
        self._inline.forget(peer)
        for key in [k for k in self._unacked if k[0] == peer]:  # its sessions end them
            self._unacked.pop(key).cancel()
        for claim in [c for c in self._claims.values() if peer in c.sids]:
            self._event(now, claim, Event.PEER_LOST, why=f"producer {peer} lost: {why}")
        for req in list(self._requests.values()):
            if peer in req.producers:
                self._event(now, req, Event.PEER_LOST, peer=peer, why=why)

    # -- engine events -----------------------------------------------------------------
    def expect(self, now: float, rid: str, ids: np.ndarray, producers: Sequence[str],
               timeout: float, groups: int = 1, tail: bool = False,
               sharers: int | Sequence[int] = 1, xid: int | None = None,
               sids: Sequence[int] | None = None) -> int:
        """Push: register ``ids`` with each producer (part = its index); returns the use's
        xid (``xid``, or a fresh one). ``sids``: each producer's source use, when known
        (0 or None: the one it holds or starts next). A use that cannot start (id pending,
        producer not connected) gets a FAILED result of its own."""
        names = list(producers)
        uses = [0] * len(names) if sids is None else list(sids)
        xid = self._new_xid() if xid is None else xid
        shares = [sharers] * len(names) if isinstance(sharers, int) else list(sharers)
        claim = self._claims.get(rid)
        if claim is not None and claim.mode is TransferMode.PUSH and claim.xid == xid:
            self._event(now, claim, Event.EXPECT)  # the registration continues the claim
            if rid in self._requests or any(n not in self._peers for n in names):
                for name in claim.sids:   # it fails below: the held source goes
                    if name in self._peers:
                        self._out.append(Send(name, m.Abort(rid, xid, "expect failed")))
        if rid in self._requests:
            # Its own result, its own xid and blocks: never taken for the live use's.
            self._emit(now, rid, xid, TransferMode.PUSH, ids, RequestState.FAILED,
                       InvalidRequest(f"request {rid!r} is already pending"), now)
            return xid
        missing = [n for n in names if n not in self._peers]
        if missing:
            self._emit(now, rid, xid, TransferMode.PUSH, ids, RequestState.FAILED,
                       PeerUnavailable(f"not connected to {missing}"), now)
            return xid
        req = _Request(rid, xid, TransferMode.PUSH, Phase.PUSHING, ids, names, now,
                       now + timeout, groups=groups)
        self._add(req)
        self._completions.expect(rid, req.parts)
        payload = m.encode_ids(ids)
        verify = self.config.verify and req.parts == 1
        for index, (name, share, sid) in enumerate(zip(names, shares, uses, strict=True)):
            self._out.append(Send(name, m.Register(rid, xid, payload, index, timeout, verify,
                                                   groups, tail, share, sid, now)))
        return xid

    def pull(self, now: float, tickets: Sequence[m.PullTicket], sources: Sequence[np.ndarray],
             dst: np.ndarray, budget: float, sharers: int | Sequence[int] = 1,
             xid: int | None = None, dial_s: float | None = None) -> int:
        """Pull: READ each ticket's ``sources`` (its block ids, or their tail) into ``dst``
        within ``budget`` seconds (the driver's bound from the timeout and the tickets'
        leases, unless claimed); returns the use's xid (``xid``, or a fresh one). A pull
        with a claim's xid continues that claim.

        ``dial_s``: a ticket's producer not connected yet is dialled first (a
        :class:`~kvpush.protocol.effects.Dial` of at most ``dial_s`` and the budget); the
        use waits in CONNECTING until :meth:`dialed` has answered for every one of them.
        Without it, such a pull fails at once (``PeerUnavailable``). A pull of a claim
        still CLAIMING ends the claim (no producer holds anything for it) and connects
        itself, under the claim's xid, within the tickets' lease."""
        rid = tickets[0].request_id
        xid = self._new_xid() if xid is None else xid
        names = [t.producer for t in tickets]
        claiming = self._claims.get(rid)
        if claiming is not None and claiming.phase is Phase.CLAIMING and claiming.xid == xid:
            budget = min(budget, claiming.lease_end - now)
            self._event(now, claiming, Event.PULL, why="its pull came first")
        waited = self._requests.get(rid)
        if waited is not None and waited.phase is Phase.CONNECTING and waited.xid == xid:
            self._event(now, waited, Event.PULL)  # connected: the pull begins
        elif dial_s is not None and budget > 0 and rid not in self._requests \
                and any(n not in self._peers for n in names):
            self._connect_first(now, tickets, sources, dst, budget, sharers, xid, dial_s)
            return xid
        claim: _Request | None = self._claims.get(rid)
        if claim is not None and claim.mode is TransferMode.PULL and claim.xid == xid:
            self._event(now, claim, Event.PULL)  # the pull continues the claim
        else:
            claim = None
        error: KvpushError | None = None
        state = RequestState.FAILED
        plans: list[Any] = []
        if rid in self._requests:
            error = InvalidRequest(f"request {rid!r} is already pending")
        elif budget <= 0:
            state, error = RequestState.TIMED_OUT, TransferTimeout(
                f"the pull ticket's lease for {rid!r} has run out")
        elif any(n not in self._peers for n in names):
            error = PeerUnavailable(f"not connected to all of {names}")
        elif self.config.verify and len(tickets) == 1 and \
                len(tickets[0].checksums) != 8 * len(dst):
            error = TransferFailed(f"verify is on but the ticket for {rid!r} carries no "
                                   "per-block checksums (set ProducerConfig.verify)")
        else:
            try:
                plans = [self.links.plan(n, dst, src, self.config.coalesce)
                         for n, src in zip(names, sources, strict=True)]
            except KvpushError as exc:
                error = exc
        if error is not None:
            if claim is not None:  # a claimed source is held for us: give it up
                for name in claim.sids:
                    if name in self._peers:
                        self._out.append(Send(name, m.Abort(rid, xid, str(error))))
            self._emit(now, rid, xid, TransferMode.PULL, dst, state, error, now)
            return xid
        req = _Request(rid, xid, TransferMode.PULL, Phase.PULLING, dst, names, now,
                       now + budget)
        req.sids = {t.producer: t.sid for t in tickets}
        req.sharers = _per_ticket(tickets, sharers)
        if self.config.verify and len(tickets) == 1:
            req.checksums = tickets[0].checksums
        self._add(req)
        for name, plan in zip(names, plans, strict=True):
            sid = req.sids[name]
            if plan.num_blocks == 0:  # see Posted.empty: no NIXL traffic for nothing
                self._out.append(Send(name, m.PullDone(rid, xid, sid, 0, req.sharers[name])))
                continue
            nbytes = len(plan.local_indices) * self.links.desc_bytes(name)
            req.moved += nbytes
            key = next(self._keys)
            req.reads[key] = _Read(name, nbytes)
            req.unheld.add(name)
            self._read_of[key] = rid
            # The producer's PullHeld gates READY: ask before the READ so the round trip
            # overlaps it. Its hold_s counts from this moment (see _on_held).
            req.began[name] = now
            self._out.append(Send(name, m.PullBegin(
                rid, xid, sid, req.sharers[name],
                inline_s=self._inline.hint(name, nbytes.bit_length()))))
            self._out.append(Post(key, "READ", name, plan.local_indices, plan.remote_indices,
                                  m.PullDone(rid, xid, sid, nbytes, req.sharers[name]), nbytes,
                                  plan.num_descriptors, getattr(plan, "runs", None),
                                  (0, self.layout.num_regions)))
        if not req.reads:
            self._pull_done(now, req)
        return xid

    def _connect_first(self, now: float, tickets: Sequence[m.PullTicket],
                       sources: Sequence[np.ndarray], dst: np.ndarray, budget: float,
                       sharers: int | Sequence[int], xid: int, dial_s: float) -> None:
        """A pull whose producers are not all connected: it waits in CONNECTING (its
        record, its deadline: the budget) while the driver dials the others."""
        rid = tickets[0].request_id
        req = _Request(rid, xid, TransferMode.PULL, Phase.CONNECTING, dst, [], now,
                       now + budget)
        req.dialing = {t.address: t for t in tickets if t.producer not in self._peers}
        req.begin = (list(tickets), list(sources), sharers)
        self._add(req)
        for address in req.dialing:
            self._out.append(Dial(address, min(dial_s, budget)))

    def dialed(self, now: float, address: str, name: str | None,
               error: KvpushError | None) -> None:
        """The driver's answer to a :class:`~kvpush.protocol.effects.Dial`: the producer
        at ``address`` is connected as ``name``, or its handshake failed with ``error``.
        Every connecting pull waiting on it goes on: it fails (FAILED, nothing posted: its
        blocks are safe) when the handshake failed, the address is another producer than
        its ticket names, or the producer's blocks do not match this pull's; it begins
        once none is left to dial. A claiming claim is given up the same ways (no result)
        and sends its Claim once none is left to dial."""
        for claim in [c for c in self._claims.values()
                      if c.phase is Phase.CLAIMING and address in c.dialing]:
            failed = _dial_error(claim.dialing.pop(address), name, error)
            if failed is not None:
                self._event(now, claim, Event.CONNECT_FAILED, error=failed)
            elif not claim.dialing:
                self._event(now, claim, Event.CONNECTED)
        for req in [r for r in self._requests.values()
                    if r.phase is Phase.CONNECTING and address in r.dialing]:
            t = req.dialing.pop(address)
            tickets, sources, sharers = req.begin
            failed = _dial_error(t, name, error)
            if failed is None:
                failed = pull_length_error(t, sources[tickets.index(t)], req.ids,
                                           self.layout, self._layouts.get(t.producer))
            if failed is not None:
                self._event(now, req, Event.CONNECT_FAILED, state=RequestState.FAILED,
                            error=failed)
            elif not req.dialing:
                self.pull(now, tickets, sources, req.ids, req.deadline - now, sharers,
                          req.xid)

    def claim(self, now: float, tickets: m.PullTicket | Sequence[m.PullTicket],
              sharers: int | Sequence[int] = 1, xid: int | None = None,
              dial_s: float | None = None, lease_s: float = math.inf) -> int:
        """Pull later: ask each ticket's producer to hold its source use for this consumer;
        returns the claim's xid, which the pull passes to continue it.

        ``dial_s``: a ticket's producer not connected yet is dialled first (a
        :class:`~kvpush.protocol.effects.Dial` of at most ``dial_s`` and ``lease_s``, the
        seconds left of the tickets' leases); the claim waits in CLAIMING and is given up
        (logged, no result) if a handshake fails, reaches another producer, or has not
        ended by then. Without it, only the producers connected now are sent the Claim."""
        batch = [tickets] if isinstance(tickets, m.PullTicket) else list(tickets)
        xid = self._new_xid() if xid is None else xid
        claim = self._claim(now, batch[0].request_id, xid, TransferMode.PULL,
                            {t.producer: t.sid for t in batch}, _per_ticket(batch, sharers))
        missing = {t.address: t for t in batch if t.producer not in self._peers}
        if dial_s is None or not missing:
            self._send_claim(claim)
            return xid
        claim.phase, claim.dialing, claim.lease_end = Phase.CLAIMING, missing, now + lease_s
        claim.deadline = now + min(dial_s, lease_s)
        if claim.deadline <= now:
            self._event(now, claim, Event.DEADLINE)
            return xid
        self._arm(claim, claim.deadline, "deadline")
        for address in claim.dialing:
            self._out.append(Dial(address, claim.deadline - now))
        return xid

    def claim_push(self, now: float, rid: str, producers: Sequence[str],
                   sharers: int | Sequence[int] = 1, xid: int | None = None) -> int:
        """Push later: this consumer will register ``rid`` with each producer but has no
        blocks yet; asks them to hold its source past the lease meanwhile. Returns the
        claim's xid, which :meth:`expect` passes to continue it."""
        names = list(producers)
        xid = self._new_xid() if xid is None else xid
        counts = [sharers] * len(names) if isinstance(sharers, int) else list(sharers)
        if len(counts) != len(names):
            raise ValueError(f"sharers names {len(counts)} counts for {len(names)} producers")
        self._send_claim(self._claim(now, rid, xid, TransferMode.PUSH, dict.fromkeys(names, 0),
                                     dict(zip(names, counts, strict=True))))
        return xid

    def abort_claim(self, now: float, rid: str, xid: int, reason: str) -> None:
        """Give a claim up (the engine's abort, or a pull of another source use); the
        producers it was sent to are told."""
        claim = self._claims.get(rid)
        if claim is None or claim.xid != xid:
            return
        self._event(now, claim, Event.ABORT, why=reason)

    def abort(self, now: float, rid: str, state: RequestState, error: KvpushError) -> None:
        """The engine gives ``rid``'s live use up (no use: nothing happens)."""
        req = self._requests.get(rid)
        if req is not None:
            self._event(now, req, Event.ABORT, state=state, error=error)

    def close(self, now: float) -> None:
        """The consumer closes: every use ends ABORTED (``ClosedError``) once its READs
        are abandoned; what may still land makes it ``blocks_safe=False``."""
        for claim in list(self._claims.values()):
            self._event(now, claim, Event.CLOSE, why="consumer closed", tell=False)
        for timer in self._unacked.values():  # the Bye ends every claim
            timer.cancel()
        self._unacked.clear()
        for req in list(self._requests.values()):
            self._event(now, req, Event.CLOSE)

    # -- network events ----------------------------------------------------------------
    def on_message(self, now: float, peer: str, msg: m.Message) -> None:
        """A decoded control frame about a request from connected producer ``peer``."""
        if isinstance(msg, m.Posted):
            if msg.empty:  # nothing to write: the part counts as landed now
                self._request_event(now, peer, msg.request_id, msg.xid, Event.LANDED,
                                    part=msg.part, nbytes=0, checksums=b"")
            else:
                self._request_event(now, peer, msg.request_id, msg.xid, Event.POSTED,
                                    part=msg.part, inline_s=msg.inline_s)
        elif isinstance(msg, m.Failed):
            if not self._drop_claim(now, peer, msg, Event.FAILED):
                self._request_event(now, peer, msg.request_id, msg.xid, Event.FAILED,
                                    msg=msg)
        elif isinstance(msg, m.AbortAck):
            unacked = self._unacked.pop((peer, msg.request_id, msg.xid), None)
            if unacked is not None:  # a claim given up here: nothing else to do
                unacked.cancel()
                return
            self._request_event(now, peer, msg.request_id, msg.xid, Event.ABORT_ACK, msg=msg)
        elif isinstance(msg, m.PullHeld):
            self._request_event(now, peer, msg.request_id, msg.xid, Event.PULL_HELD, msg=msg)
        elif isinstance(msg, m.Abort):
            if not self._drop_claim(now, peer, msg, Event.PEER_ABORT):
                self._request_event(now, peer, msg.request_id, msg.xid, Event.PEER_ABORT,
                                    msg=msg)
        else:
            self.stats.messages_rejected += 1

    def on_notification(self, now: float, peer: str, msg: m.Message,
                        since: float | None = None) -> None:
        """A decoded NIXL notification from ``peer`` (a push part's ``Landed``), read at
        ``now``. ``since``: when the driver last looked for notifications before it, so it
        arrived in between (None: not known; it is then taken to have arrived ``now``)."""
        if isinstance(msg, m.Landed):
            self._request_event(now, peer, msg.request_id, msg.xid, Event.LANDED,
                                part=msg.part, nbytes=msg.nbytes, checksums=msg.checksums,
                                since=since)
        else:
            self.stats.messages_rejected += 1

    def transfer_ended(self, now: float, key: int, end: XferEnd,
                       inline_s: float = 0.0) -> None:
        """The driver: READ ``key`` ended (or was abandoned; ``inline_s``: by the time its
        post returned, which took that long)."""
        rid = self._read_of.pop(key, None)
        req = self._requests.get(rid) if rid is not None else None
        if req is None or key not in req.reads:
            log.warning("consumer core: end of unknown transfer %d", key)
            return
        read = req.reads[key]
        if end is XferEnd.DONE and read.peer in self._peers:
            self._inline.ended(read.peer, read.nbytes.bit_length(), inline_s)
        self._event(now, req, Event.READ_ENDED, key=key, end=end)

    def tick(self, now: float) -> None:
        """Run every deadline due by ``now``."""
        for fire in self._timers.pop_due(now):
            fire(now)

    # -- the state machine -------------------------------------------------------------
    def _request_event(self, now: float, peer: str, rid: str, xid: int, event: Event,
                       **args: Any) -> None:
        req = self._requests.get(rid)
        if req is None or req.xid != xid or peer not in req.producers:
            # Another use of the id (earlier, or another consumer's), or none: it changes
            # nothing here.
            self.stats.stale_messages += 1
            msg = args.get("msg")
            if isinstance(msg, m.Failed) and msg.unfenced:
                # The producer holds the source until we acknowledge that its abandoned
                # WRITE is not trusted here (this use has ended: nothing of it will be).
                self._out.append(Send(peer, m.Abort(rid, xid, "unfenced write acknowledged")))
            return
        self._event(now, req, event, peer=peer, **args)

    def _event(self, now: float, req: _Request, event: Event, **args: Any) -> None:
        """Run ``event``'s row of ``req``'s phase (refused without one) and check the phase
        it led to."""
        before = req.phase
        r = TABLE.row(before, event)
        if r is None:
            self._refuse(req, event, "not allowed in this phase")
            return
        if r.handler is not None:
            getattr(self, r.handler)(now, req, **args)
        if req.phase not in r.to:
            TABLE.check(before, event, req.phase)

    # claims
    def _claim(self, now: float, rid: str, xid: int, mode: TransferMode,
               sids: dict[str, int], sharers: dict[str, int]) -> _Request:
        old = self._claims.get(rid)
        if old is not None and old.xid != xid:
            # One claim per request id here: a new one gives the earlier up, at its
            # producers too. Replaced silently, the earlier claim would hold their sources
            # up to max_wait_s with nothing here left to end it.
            self._end_claim(now, old, "superseded by a new claim of the request")
        claim = _Request(rid, xid, mode, Phase.CLAIMED, np.empty(0, dtype=np.int64),
                         list(sids), now, math.inf, sids=sids, sharers=sharers)
        self._claims[rid] = claim
        return claim

    def _send_claim(self, claim: _Request) -> None:
        """The Claim to each of its producers connected now."""
        push = claim.mode is TransferMode.PUSH
        for name, sid in claim.sids.items():
            if name in self._peers:
                self._out.append(Send(name, m.Claim(claim.rid, claim.xid, sid,
                                                    claim.sharers[name], push=push)))

    def _claim_connected(self, now: float, req: _Request) -> None:
        self._disarm(req)
        req.phase, req.deadline = Phase.CLAIMED, math.inf
        self._send_claim(req)

    def _claim_failed(self, now: float, req: _Request, error: KvpushError | None = None) -> None:
        """A claiming claim could not be made (no producer holds anything for it): a pull
        of its tickets meets the same handshake itself."""
        why = str(error or "its producers did not all connect in time")
        if not isinstance(error, ClosedError):
            log.warning("consumer core: claim of %r given up: %s", req.rid, why)
        self._end_claim(now, req, why)

    def _continue_claim(self, now: float, req: _Request) -> None:
        """The engine's expect or pull continues the claim: its use begins (a record of its
        own, under the claim's xid)."""
        del self._claims[req.rid]
        req.phase = Phase.PUSHING if req.mode is TransferMode.PUSH else Phase.PULLING

    def _connected(self, now: float, req: _Request) -> None:
        self._disarm(req)
        del self._requests[req.rid]
        LIVE.add("requests_pending", -1)
        req.phase = Phase.PULLING

    def _end_unstarted(self, now: float, req: _Request,
                       state: RequestState = RequestState.ABORTED,
                       error: KvpushError | None = None) -> None:
        """A use that ends before it began (in its handshake): reported at once, its
        blocks safe (nothing was posted)."""
        self._disarm(req)
        del self._requests[req.rid]
        LIVE.add("requests_pending", -1)
        req.phase = Phase.DONE
        self._emit(now, req.rid, req.xid, req.mode, req.ids, state,
                   error or ClosedError("consumer closed"), req.started)

    def _end_claim(self, now: float, req: _Request, why: str, by: str | None = None,
                   tell: bool = True) -> None:
        """The claim is given up (no result: nothing was begun); the facade is told, and so
        is each producer its Claim went to that is still connected, save ``by`` (the one
        that refused or gave it up): otherwise it holds its source for the claim up to
        ``max_wait_s``, whichever way the claim ended here (the engine's abort, one producer
        of several lost or refusing). ``tell=False``: this side is closing, its Bye ends
        every claim at once."""
        sent = req.phase is Phase.CLAIMED
        self._disarm(req)
        if self._claims.get(req.rid) is req:
            del self._claims[req.rid]
        req.phase = Phase.DONE
        self._out.append(Emit(ClaimGone(req.rid, req.xid)))
        log.info("consumer core: claim of %r dropped: %s", req.rid, why)
        if sent and tell:
            for name in req.sids:
                if name != by and name in self._peers:
                    self._say_claim_gone(now, (name, req.rid, req.xid), why)

    def _say_claim_gone(self, now: float, key: tuple[str, str, int], why: str) -> None:
        """Tell a producer a claim is given up, and again every ``abort_grace_s`` until it
        acknowledges: the Abort can be lost with a TCP connection ZeroMQ replaces at once
        (neither side sees a peer loss), and the producer would hold its source for the
        claim up to ``max_wait_s``. Its AbortAck, its loss or this side's close ends it."""
        peer, rid, xid = key
        self._out.append(Send(peer, m.Abort(rid, xid, why)))
        self._unacked[key] = self._timers.add(now + self.config.abort_grace_s,
                                              self._claim_unacked, (key, why))

    def _claim_unacked(self, entry: tuple[tuple[str, str, int], str], now: float) -> None:
        """No AbortAck yet (an acknowledged claim, or one whose producer was lost, has no
        entry: its timer was cancelled)."""
        key, why = entry
        if self._unacked.pop(key, None) is not None:
            self._say_claim_gone(now, key, why)

    def _refuse(self, req: _Request, event: Event, why: str) -> None:
        self.stats.events_refused += 1
        log.info("consumer core: %s of %r (xid %x) in %s refused: %s", event.value, req.rid,
                 req.xid, req.phase.value, why)

    # push
    def _on_posted(self, now: float, req: _Request, peer: str, part: int,
                   inline_s: float = 0.0) -> None:
        if not 0 <= part < req.parts or req.producer_of(part) != peer \
                or part in req.settled or part in req.posted:
            self._refuse(req, Event.POSTED, f"part {part}")
            return
        req.posted[part] = now
        if inline_s > 0:
            req.inline[part] = inline_s
        self._posting[req.rid] = req

    def _on_landed(self, now: float, req: _Request, peer: str, part: int, nbytes: int,
                   checksums: bytes, since: float | None = None) -> None:
        if not 0 <= part < req.parts or req.producer_of(part) != peer:
            self._refuse(req, Event.LANDED, f"part {part} is not {peer}'s")
            return
        # Counted once per (use, part): a replayed or duplicated Landed changes nothing
        # (which is why notifications need no replay window).
        arrival = self._completions.arrive(req.rid, part)
        if arrival not in (_core.Arrival.PENDING, _core.Arrival.COMPLETE):
            self._refuse(req, Event.LANDED, f"part {part}: {arrival.name.lower()}")
            return
        hinted = req.posted.get(part)
        if hinted is not None:
            self._landings.learn(self._size_class(req), hinted, now, since)
        req.landed.add(part)
        self._settle(req, part)
        if part % req.groups == 0:
            self.stats.blocks_moved += len(req.ids)
        req.moved += nbytes
        self.stats.bytes_moved += nbytes
        if req.phase is Phase.PUSHING and req.parts == 1 and self.config.verify:
            mismatch = self._verify(req, checksums)
            if mismatch is not None:
                self._begin_close(now, req, RequestState.FAILED, mismatch, ask=False)
                return
        if req.phase is Phase.PUSH_CLOSING:
            req.fence.discard(part)
            if req.settled_producer(peer):
                req.waiting_acks.discard(peer)
            self._try_finish(now, req)
        elif arrival == _core.Arrival.COMPLETE:
            self._finish(now, req, RequestState.READY, None)

    def _on_ack(self, now: float, req: _Request, peer: str, msg: m.AbortAck | m.Failed) -> None:
        """The producer's WRITEs have all ended (AbortAck, or a Failed while closing)."""
        req.unsafe |= msg.unfenced
        self._settle_producer(req, peer, msg.errored)
        req.waiting_acks.discard(peer)
        self._try_finish(now, req)

    # pull
    def _on_held(self, now: float, req: _Request, peer: str, msg: m.PullHeld) -> None:
        if peer not in req.unheld:
            self._refuse(req, Event.PULL_HELD, f"{peer} already answered")
            return
        req.unheld.discard(peer)
        # The producer holds the source hold_s from its receipt of our PullBegin, which is
        # after we sent it: counted from our send, the guarantee is never overstated. (A
        # NaN or negative hold guarantees nothing.)
        hold = msg.hold_s if msg.hold_s >= 0 else -math.inf
        req.held_until[peer] = req.began.get(peer, -math.inf) + hold
        if not req.unheld and not req.reads:
            self._pull_done(now, req)

    def _on_read_ended(self, now: float, req: _Request, key: int, end: XferEnd) -> None:
        read = req.reads.pop(key)
        req.read_end[read.peer] = now
        if end is XferEnd.ABANDONED:
            req.unsafe = True  # its bytes may land at any later time
            self.stats.transfers_abandoned += 1
        if req.phase is Phase.PULL_CLOSING:
            self._try_finish(now, req)
        elif end is not XferEnd.DONE:
            done = m.PullDone(req.rid, req.xid, req.sids[read.peer], 0,
                              req.sharers.get(read.peer, 1))
            self._begin_close(now, req, RequestState.FAILED, PeerUnavailable(
                f"producer {read.peer} unreachable for the READ of {req.rid!r}")
                if end is XferEnd.LOST else
                TransferFailed(f"READ of {req.rid!r} from {read.peer} {end.value}"), ask=True)
            if end is not XferEnd.ABANDONED:
                # Nothing more reads the source: the producer need not wait for us. After
                # the Abort, so the producer counts this owner as given up, not done.
                self._out.append(Send(read.peer, done))
        elif not req.reads and not req.unheld:
            self._pull_done(now, req)

    # both
    def _on_failed(self, now: float, req: _Request, peer: str, msg: m.Failed) -> None:
        state, cls = _FAILED_CODES.get(msg.code, (RequestState.FAILED, TransferFailed))
        error = cls(f"producer {peer}: {msg.code}: {msg.reason}")
        # This producer's WRITEs have all ended: it will write nothing more.
        req.unsafe |= msg.unfenced
        if req.mode is TransferMode.PUSH:
            self._settle_producer(req, peer, msg.errored)
        req.unheld.discard(peer)
        self._begin_close(now, req, state, error, ask=True)

    def _on_peer_abort(self, now: float, req: _Request, peer: str, msg: m.Abort) -> None:
        """The producer gave the use up while a WRITE was in flight: it ends ABORTED once
        that WRITE has (its Failed follows, then the Landed of what was posted)."""
        self._begin_close(now, req, RequestState.ABORTED,
                          RequestAborted(f"producer {peer}: {msg.reason}"), ask=True)

    def _on_deadline(self, now: float, req: _Request) -> None:
        what = "READ" if req.mode is TransferMode.PULL else "data"
        self._begin_close(now, req, RequestState.TIMED_OUT,
                          TransferTimeout(f"{what} for {req.rid!r} did not land in time"),
                          ask=True)

    def _on_abort(self, now: float, req: _Request, state: RequestState,
                  error: KvpushError) -> None:
        self._begin_close(now, req, state, error, ask=True)

    def _on_peer_lost(self, now: float, req: _Request, peer: str, why: str) -> None:
        # What it may still have in flight cannot be waited for any more: a READ is
        # abandoned, and a push part that has not landed may land later: its WRITE may
        # have been posted even if its Posted hint was lost with the link (over TCP a cut
        # link keeps UCX's connection; see blocks_safe).
        for part in req.parts_of(peer):
            if req.mode is TransferMode.PUSH and part not in req.settled:
                req.unsafe = True
            req.fence.discard(part)
            self._settle(req, part)
        req.unheld.discard(peer)
        req.waiting_acks.discard(peer)
        self._abandon_reads(req, peer)
        if req.phase in (Phase.PUSHING, Phase.PULLING):
            self._begin_close(now, req, RequestState.FAILED,
                              PeerUnavailable(f"producer {peer} lost: {why}"), ask=True)
        else:
            self._try_finish(now, req)

    def _on_grace_over(self, now: float, req: _Request) -> None:
        """``abort_grace_s`` after the close began, something may still land: report with
        ``blocks_safe=False`` once any READ still in flight has been abandoned. NIXL may
        refuse to let go of one (the driver then keeps polling it): the abandon is asked
        again each grace, and after :data:`GRACE_ROUNDS` the use ends without it -- a
        grace that fired once left such a use, and its engine's request, waiting forever."""
        req.graces += 1
        if req.graces > 1:
            if req.graces >= GRACE_ROUNDS:
                log.error("consumer core: %r: NIXL did not let go of %d READ(s) in %d "
                          "graces; the use ends without them (blocks unsafe)", req.rid,
                          len(req.reads), req.graces)
                for key in req.reads:
                    self._read_of.pop(key, None)
                req.reads.clear()
            for read in req.reads.values():
                read.abandoning = False
            self._abandon_reads(req, None)
            self._rearm_grace(now, req)
            return
        log.warning("consumer core: %r not fenced after %s s (READs from %s, no "
                    "confirmation from %s, Landed awaited for parts %s): its blocks are "
                    "reported unsafe", req.rid, self.config.abort_grace_s,
                    sorted(r.peer for r in req.reads.values()), sorted(req.waiting_acks),
                    sorted(req.fence))
        self._ask_abort(req)  # a pull's producer may release its blocks now
        req.unsafe = True
        req.waiting_acks.clear()
        req.fence.clear()
        self._abandon_reads(req, None)
        self._rearm_grace(now, req)

    def _rearm_grace(self, now: float, req: _Request) -> None:
        if not self._try_finish(now, req):
            req.grace = now + self.config.abort_grace_s
            self._arm(req, req.grace, "grace")

    def _on_close(self, now: float, req: _Request) -> None:
        if req.mode is TransferMode.PUSH:
            # A part not landed may still be written: its WRITE may be posted though its
            # Posted hint has not come (or never will: Bye ends nothing in flight), so every
            # such part, not only announced ones, leaves the blocks unsafe.
            req.unsafe |= any(p not in req.landed and p not in req.settled
                              for p in range(req.parts))
        req.end, req.error = RequestState.ABORTED, ClosedError("consumer closed")
        req.phase = _CLOSING[req.phase]
        req.waiting_acks.clear()
        req.fence.clear()
        req.asked = True  # the driver says Bye to every producer
        self._abandon_reads(req, None)
        self._try_finish(now, req)

    # -- endings -----------------------------------------------------------------------
    def _begin_close(self, now: float, req: _Request, state: RequestState,
                     error: KvpushError | None, ask: bool) -> None:
        """Begin ending a use that did not succeed: ask the producers to abort, and report
        once nothing can land any more (see the module docstring)."""
        req.phase = _CLOSING[req.phase]
        req.end, req.error = state, error
        if ask:
            self._ask_abort(req)
        if not self._try_finish(now, req) and req.grace is None:
            req.grace = now + self.config.abort_grace_s
            self._arm(req, req.grace, "grace")

    def _ask_abort(self, req: _Request) -> None:
        """Send Abort to the use's producers (once); push: wait for the AbortAck of each
        that may still be writing."""
        if req.asked:
            return
        req.asked = True
        reason = str(req.error) if req.error else "aborted"
        for name in req.producers:
            if name not in self._peers:
                continue
            self._out.append(Send(name, m.Abort(req.rid, req.xid, reason)))
            if req.mode is TransferMode.PUSH and any(
                    p not in req.settled and p not in req.fence for p in req.parts_of(name)):
                req.waiting_acks.add(name)

    def _try_finish(self, now: float, req: _Request) -> bool:
        """Report a closing use once nothing of it is in flight; True if reported."""
        if req.end is None or req.reads or req.waiting_acks or req.fence:
            return False
        self._finish(now, req, req.end, req.error)
        return True

    def _pull_done(self, now: float, req: _Request) -> None:
        """Every READ is done and every producer confirmed it held the blocks."""
        for name, ended in req.read_end.items():
            late = ended - req.held_until.get(name, -math.inf)
            if late > 0:
                # The producer may have released the blocks before our READ ended: what it
                # read is not trusted. The READ has ended, so the blocks are safe.
                self._begin_close(now, req, RequestState.FAILED, TransferFailed(
                    f"READ of {req.rid!r} from {name} ended {late:.3f} s past the hold the "
                    "producer guaranteed (PullHeld.hold_s): its data is not trusted"),
                    ask=False)
                return
        self.stats.bytes_moved += req.moved
        self.stats.blocks_moved += len(req.ids)
        mismatch = self._verify(req, req.checksums)
        if mismatch is None:
            self._finish(now, req, RequestState.READY, None)
        else:
            self._begin_close(now, req, RequestState.FAILED, mismatch, ask=False)

    def _finish(self, now: float, req: _Request, state: RequestState,
                error: KvpushError | None) -> None:
        self._disarm(req)
        del self._requests[req.rid]
        req.phase = Phase.DONE
        self._posting.pop(req.rid, None)
        if req.mode is TransferMode.PUSH:
            self._completions.remove(req.rid)
        LIVE.add("requests_pending", -1)
        self._emit(now, req.rid, req.xid, req.mode, req.ids, state, error, req.started,
                   req.moved, not req.unsafe)

    def _emit(self, now: float, rid: str, xid: int, mode: TransferMode, ids: np.ndarray,
              state: RequestState, error: KvpushError | None, started: float,
              nbytes: int = 0, safe: bool = True) -> None:
        counter = _COUNTERS[state]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.results_unsafe += not safe
        self._out.append(Emit(TransferResult(rid, state, mode, error, now - started, nbytes,
                                             safe, ids, xid)))

    # -- helpers -----------------------------------------------------------------------
    def _add(self, req: _Request) -> None:
        self._requests[req.rid] = req
        LIVE.add("requests_pending", 1)
        self._arm(req, req.deadline, "deadline")
        if self._unacked:
            # A use under a given-up claim's xid (the engine continued the claim before it
            # heard it was gone): an Abort said again after its Register would end it.
            for key in [k for k in self._unacked if k[1:] == (req.rid, req.xid)]:
                self._unacked.pop(key).cancel()

    def _arm(self, req: _Request, when: float, kind: str) -> None:
        """Arm ``req``'s one timer (its earlier one is cancelled): at a high request rate
        the heap holds the live uses' timers, not one per use ever made."""
        if req.timer is not None:
            req.timer.cancel()
        req.timer = self._timers.add(when, self._due, (req, kind, when))

    def _disarm(self, req: _Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None

    def _due(self, entry: tuple[_Request, str, float], now: float) -> None:
        """A use's timer: its deadline applies while it is not closing; its grace once
        it is."""
        req, kind, when = entry
        req.timer = None
        if self._requests.get(req.rid) is not req and self._claims.get(req.rid) is not req:
            return
        if kind == "deadline":
            if req.phase in (Phase.PUSHING, Phase.PULLING, Phase.CLAIMING):
                self._event(now, req, Event.DEADLINE)
        elif req.grace == when:
            self._event(now, req, Event.GRACE_OVER)

    def _abandon_reads(self, req: _Request, peer: str | None) -> None:
        for key, read in req.reads.items():
            if (peer is None or read.peer == peer) and not read.abandoning:
                read.abandoning = True
                self._out.append(Abandon(key))

    def _settle(self, req: _Request, part: int) -> None:
        """Part ``part`` of ``req`` will write nothing more."""
        req.settled.add(part)
        req.inline.pop(part, None)
        if req.posted.pop(part, None) is not None and not req.posted:
            self._posting.pop(req.rid, None)

    def _settle_producer(self, req: _Request, name: str, errored: Iterable[int]) -> None:
        """Producer ``name`` writes nothing more for ``req``. A part it announced (Posted)
        and whose WRITE did not end in error may still have bytes on the way, ahead of its
        Landed notification: the use waits for that notification (its fence)."""
        errored = set(errored)
        for part in req.parts_of(name):
            if part in req.posted and part not in errored:
                req.fence.add(part)
            else:
                self._settle(req, part)

    def _drop_claim(self, now: float, peer: str, msg: m.Failed | m.Abort,
                    event: Event) -> bool:
        """A producer refused or gave up a claim: drop it, so a later pull starts anew."""
        claim = self._claims.get(msg.request_id)
        if claim is None or claim.xid != msg.xid or peer not in claim.sids:
            return False
        self._event(now, claim, event, why=f"by {peer}: {msg.reason}", by=peer)
        return True

    def _verify(self, req: _Request, checksums: bytes | None) -> KvpushError | None:
        """None when the landed blocks match the producer's checksums (or verify is off)."""
        if checksums is None:
            return None
        if len(checksums) != 8 * len(req.ids):
            return TransferFailed(f"{req.rid!r}: the producer sent {len(checksums) // 8} "
                                  f"checksums for {len(req.ids)} blocks")
        want = np.frombuffer(checksums, dtype="<u8")
        got = self.links.checksums(req.ids)
        if isinstance(got, (bytes, bytearray)):
            got = np.frombuffer(got, dtype="<u8")
        bad = np.nonzero(got != want)[0]
        if len(bad) == 0:
            return None
        self.stats.checksum_mismatches += len(bad)
        return TransferFailed(f"{req.rid!r}: {len(bad)} block(s) differ from the source "
                              f"after transfer, e.g. block {int(req.ids[bad[0]])}")

    def _size_class(self, req: _Request) -> int:
        """Bit length of the bytes one part of ``req`` moves (all regions, whole blocks)."""
        return (len(req.ids) * self.layout.block_bytes * self.layout.num_regions
                // req.groups).bit_length()
