"""The prefill side's protocol core: sources, their owners, WRITEs, leases (sans-IO).

One record per request id (:class:`_Request`) with an explicit state (:class:`State`), and
two machines in the shape of :mod:`kvpush.protocol.table`: :data:`TABLE`, the request's
(every event goes through :meth:`ProducerCore._dispatch`, which looks the (state, event)
row up, runs its handler and checks where it led), and :data:`OWNER_TABLE`, the state of
each owner of a source (:class:`_Owner`, keyed by (consumer agent name, xid)), checked at
every change. An event without a row is refused: counted (``stats.events_refused``), logged,
and never acted on -- except that a consumer waiting for an answer gets the true one (a
``Failed`` naming the state, or an ``AbortAck`` with nothing in flight). What each state
means, the owners and when a source is released: ``docs/PROTOCOL.md``; the diagrams,
generated from the tables: ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np

from .. import messages as m
from .._enum import IdentityEnum
from ..errors import KvpushError, PeerUnavailable
from ..layout import KVLayout
from ..metrics import Stats
from ..request import OwnerStatus, Release, ReleaseReason, RequestStatus, TransferMode
from .effects import Abandon, DropPeer, Effect, Emit, Post, Send, XferEnd
from .landings import Landings, PostTimes
from .table import Row, Table, TransitionError, row
from .timers import Timer as _Timer
from .timers import TimerHeap

__all__ = ["OWNER_TABLE", "TABLE", "CoreConfig", "Event", "Links", "OwnerState",
           "ProducerCore", "Settings", "State", "waiting_ids_budget"]

log = logging.getLogger("kvpush.producer")

#: Bound on a registration's part index (producer ranks x layer groups).
MAX_PARTS = 1 << 20
#: Bound on registrations and claims waiting per consumer (a misbehaving peer cannot grow
#: this side's memory without bound).
MAX_WAITING_PER_PEER = 1 << 16
#: Bound on block ids held in registrations waiting per consumer: four times its cache (a
#: consumer's live registrations name its own allocated blocks), at least ``1 << 16``, at
#: most this many (8 bytes each), whatever cache its Hello claims.
MAX_IDS_PER_PEER = 1 << 22
#: Failed xids a request's record remembers (the oldest forgotten first): every owner of a
#: use twice over.
MAX_FAILED_PER_REQUEST = 2 * m.MAX_SHARERS


def waiting_ids_budget(consumer_blocks: int) -> int:
    """Block ids a consumer with ``consumer_blocks`` blocks may have waiting here in
    registrations (:data:`MAX_IDS_PER_PEER`); a registration past it is refused
    ``too_many``."""
    return min(max(4 * consumer_blocks, 1 << 16), MAX_IDS_PER_PEER)


class State(IdentityEnum):
    WAITING = "waiting"
    PARTIAL = "partial"
    HELD = "held"
    ENDING = "ending"
    RELEASED_EARLY = "released_early"
    ENDED = "ended"
    ABORTED_EARLY = "aborted_early"


class Event(IdentityEnum):
    PREFILL_DONE = "prefill_done"
    LAYER_DONE = "layer_done"
    ENGINE_ABORT = "engine_abort"
    REGISTER = "register"
    CLAIM = "claim"
    PULL_BEGIN = "pull_begin"
    PULL_DONE = "pull_done"
    CONSUMER_ABORT = "consumer_abort"
    WRITE_ENDED = "write_ended"    # a WRITE ended (done, in error, abandoned, lost)
    PEER_LOST = "peer_lost"        # a consumer is gone
    WAIT_OVER = "wait_over"        # an owner's wait (max_wait_s, the Register's wait_s) ran out
    FENCE_OVER = "fence_over"      # a fenced owner's wait for its Abort ran out
    HOLD_OVER = "hold_over"        # a pulling owner's hold ran out
    LEASE_OVER = "lease_over"      # the source's lease ran out
    TOMB_OVER = "tomb_over"        # the record's tombstone ran out
    RELEASE = "release"            # owner machine only: the source was released
    CLOSE = "close"                # owner machine only: the producer closes


S, E = State, Event
#: The request machine: for each state, the events it accepts, the handler of each and the
#: states it may lead to (:mod:`kvpush.protocol.table`). After every event,
#: :meth:`ProducerCore._settle` releases a source that is done with, or forgets a record
#: with nothing left: the ``release`` row of the state the handler left says where that may
#: lead (WAITING after a release: the next use's registrations were queued). An engine or
#: consumer event without a row is refused; an internal one (a timer, a transfer's end, a
#: lost peer) without a row is a bug. ``close`` forgets every record, outside the table.
TABLE: Table[State, Event] = Table("producer request", {
    S.WAITING: {
        E.PREFILL_DONE: row("_on_prefill_done", S.HELD),
        E.LAYER_DONE: row("_on_layer_done", S.PARTIAL),
        E.ENGINE_ABORT: row("_on_engine_abort", S.ABORTED_EARLY),
        E.REGISTER: row("_on_register", S.WAITING),
        E.CLAIM: row("_on_claim", S.WAITING),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.WAITING),
        E.PEER_LOST: row("_on_peer_lost", S.WAITING),
        E.WAIT_OVER: row("_on_wait_over", S.WAITING),
        E.TOMB_OVER: row("_on_tomb_over", S.WAITING),
        E.RELEASE: row("_settle", S.WAITING),
    },
    S.PARTIAL: {
        E.PREFILL_DONE: row("_on_prefill_done", S.HELD),
        E.LAYER_DONE: row("_on_layer_done", S.PARTIAL),
        E.ENGINE_ABORT: row("_on_engine_abort", S.ENDING),
        E.REGISTER: row("_on_register", S.PARTIAL),
        E.CLAIM: row("_on_claim", S.PARTIAL),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.PARTIAL),
        E.WRITE_ENDED: row("_on_write_ended", S.PARTIAL),
        E.PEER_LOST: row("_on_peer_lost", S.PARTIAL),
        E.WAIT_OVER: row("_on_wait_over", S.PARTIAL),
        E.FENCE_OVER: row("_on_fence_over", S.PARTIAL),
        E.TOMB_OVER: row("_on_tomb_over", S.PARTIAL),
        E.RELEASE: row("_settle", S.PARTIAL, S.RELEASED_EARLY),
    },
    S.HELD: {
        E.ENGINE_ABORT: row("_on_engine_abort", S.ENDING),
        E.REGISTER: row("_on_register", S.HELD),
        E.CLAIM: row("_on_claim", S.HELD),
        E.PULL_BEGIN: row("_on_pull_begin", S.HELD),
        E.PULL_DONE: row("_on_pull_done", S.HELD),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.HELD),
        E.PREFILL_DONE: row("_on_prefill_done", S.HELD),   # a second one
        E.WRITE_ENDED: row("_on_write_ended", S.HELD),
        E.PEER_LOST: row("_on_peer_lost", S.HELD),
        E.WAIT_OVER: row("_on_wait_over", S.HELD),
        E.FENCE_OVER: row("_on_fence_over", S.HELD),
        E.HOLD_OVER: row("_on_hold_over", S.HELD),
        E.LEASE_OVER: row("_on_lease_over", S.HELD),
        E.TOMB_OVER: row("_on_tomb_over", S.HELD),
        E.RELEASE: row("_settle", S.HELD, S.ENDED, S.WAITING),
    },
    S.ENDING: {
        E.PULL_DONE: row("_on_pull_done", S.ENDING),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.ENDING),
        E.PREFILL_DONE: row("_on_prefill_done", S.ENDING),
        E.WRITE_ENDED: row("_on_write_ended", S.ENDING),
        E.PEER_LOST: row("_on_peer_lost", S.ENDING),
        E.WAIT_OVER: row("_on_wait_over", S.ENDING),
        E.FENCE_OVER: row("_on_fence_over", S.ENDING),
        E.HOLD_OVER: row("_on_hold_over", S.ENDING),
        E.LEASE_OVER: row("_on_lease_over", S.ENDING),
        E.TOMB_OVER: row("_on_tomb_over", S.ENDING),
        E.RELEASE: row("_settle", S.ENDING, S.ENDED, S.RELEASED_EARLY, S.WAITING),
    },
    S.RELEASED_EARLY: {
        # its own prefill_done settles the use; another use's starts a new one
        E.PREFILL_DONE: row("_on_prefill_done", S.ENDED, S.HELD),
        E.LAYER_DONE: row("_on_layer_done", S.RELEASED_EARLY),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.RELEASED_EARLY),
        E.ENGINE_ABORT: row("_on_engine_abort", S.RELEASED_EARLY),
        E.TOMB_OVER: row("_on_tomb_over", S.RELEASED_EARLY),
    },
    # ENDED: a register (or a push claim) is a new use unless the tombstone says late ones
    # must fail fast
    S.ENDED: {
        E.PREFILL_DONE: row("_on_prefill_done", S.HELD),
        E.LAYER_DONE: row("_on_layer_done", S.PARTIAL),
        E.REGISTER: row("_on_register", S.ENDED, S.WAITING),
        E.CLAIM: row("_on_claim", S.ENDED, S.WAITING),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.ENDED),
        # one naming a use to come (not the one that ended) aborts it before it starts
        E.ENGINE_ABORT: row("_on_engine_abort", S.ENDED, S.ABORTED_EARLY),
        E.TOMB_OVER: row("_on_tomb_over", S.ENDED),
    },
    # a prefill_done or layer_done of another use than the one aborted (both named) starts
    # that use
    S.ABORTED_EARLY: {
        E.PREFILL_DONE: row("_on_prefill_done", S.ENDED, S.ENDING, S.HELD),
        E.LAYER_DONE: row("_on_layer_done", S.RELEASED_EARLY, S.PARTIAL),
        E.CONSUMER_ABORT: row("_on_consumer_abort", S.ABORTED_EARLY),
        E.TOMB_OVER: row("_on_tomb_over", S.ABORTED_EARLY),
    },
}, initial=[S.WAITING, S.ABORTED_EARLY],
    final=[S.WAITING, S.RELEASED_EARLY, S.ENDED, S.ABORTED_EARLY])
del S, E


class OwnerState(IdentityEnum):
    REGISTERED = "registered"  # push: waiting for the source (or its final layers)
    WRITING = "writing"        # push: WRITEs posted, more groups may follow
    CLAIMED = "claimed"        # announced, not begun (pull: no READ yet; push: not
                               # registered yet, the consumer has no blocks for it)
    PULLING = "pulling"        # pull: a READ may be in flight (until PullDone or hold)
    FENCING = "fencing"        # push: a WRITE was abandoned; the consumer was told it is
                               # unfenced, and the blocks stay until it acknowledges (its
                               # Abort) or is lost: the WRITE may resume and read them
    DONE = "done"              # finished: its data was delivered
    GONE = "gone"              # gave up, failed, expired or lost: it takes nothing more


#: States in which :meth:`ProducerCore._settle` may act on a record.
_SETTLES = frozenset({State.WAITING, State.PARTIAL, State.HELD, State.ENDING})
_LIVE = frozenset({OwnerState.REGISTERED, OwnerState.WRITING, OwnerState.CLAIMED,
                   OwnerState.PULLING, OwnerState.FENCING})
#: Owners whose transfer may still read the source: it is not released while one exists.
_READING = frozenset({OwnerState.WRITING, OwnerState.PULLING, OwnerState.FENCING})

OS, E = OwnerState, Event
_GONE = row("_owner_gone", OS.GONE)
#: The owner machine: an owner changes state only inside a request event (the row names the
#: core method that makes the change), or when its source is released (``release``) or the
#: producer closes (``close``). Every change is checked against this table
#: (:meth:`ProducerCore._to`); an owner is created registered or claimed.
OWNER_TABLE: Table[OwnerState, Event] = Table("producer owner", {
    OS.REGISTERED: {
        E.PREFILL_DONE: row("_match", OS.WRITING, OS.GONE),
        E.LAYER_DONE: row("_match", OS.WRITING, OS.GONE),
        E.REGISTER: row("_match", OS.WRITING, OS.GONE),
        E.ENGINE_ABORT: _GONE, E.CONSUMER_ABORT: _GONE, E.PEER_LOST: _GONE,
        E.WAIT_OVER: _GONE, E.RELEASE: _GONE, E.CLOSE: _GONE,
    },
    OS.CLAIMED: {
        E.REGISTER: _GONE,                       # its registration takes its place
        E.PULL_BEGIN: row("_on_pull_begin", OS.PULLING),
        E.PULL_DONE: row("_on_pull_done", OS.DONE, OS.GONE),
        E.PREFILL_DONE: _GONE, E.LAYER_DONE: _GONE,   # another use, or a mode conflict
        E.ENGINE_ABORT: _GONE, E.CONSUMER_ABORT: _GONE, E.PEER_LOST: _GONE,
        E.WAIT_OVER: _GONE, E.RELEASE: _GONE, E.CLOSE: _GONE,
    },
    OS.WRITING: {
        E.WRITE_ENDED: row("_conclude", OS.DONE, OS.FENCING, OS.GONE),
        # nothing (more) to write: every group is posted and none moved bytes
        E.PREFILL_DONE: row("_conclude", OS.DONE),
        E.LAYER_DONE: row("_conclude", OS.DONE),
        E.REGISTER: row("_conclude", OS.DONE),
        E.ENGINE_ABORT: row("_conclude", OS.FENCING, OS.GONE),
        E.WAIT_OVER: row("_conclude", OS.FENCING, OS.GONE),
        E.CONSUMER_ABORT: _GONE, E.PEER_LOST: _GONE, E.CLOSE: _GONE,
    },
    OS.PULLING: {
        E.PULL_DONE: row("_on_pull_done", OS.DONE, OS.GONE),
        E.HOLD_OVER: _GONE, E.PEER_LOST: _GONE, E.CLOSE: _GONE,
    },
    OS.FENCING: {
        E.CONSUMER_ABORT: _GONE, E.FENCE_OVER: _GONE, E.PEER_LOST: _GONE, E.CLOSE: _GONE,
    },
    OS.DONE: {E.RELEASE: _GONE, E.CLOSE: _GONE},
}, initial=[OS.REGISTERED, OS.CLAIMED], final=[OS.GONE])
del OS, E, _GONE


class Links(Protocol):
    """What the core needs of the prepared descriptor lists (pure, no I/O)."""

    def plan(self, peer: str, src: np.ndarray, dst: np.ndarray, coalesce: bool) -> Any: ...

    def desc_bytes(self, peer: str) -> int: ...

    def checksums(self, ids: np.ndarray) -> bytes: ...


class Settings(Protocol):
    """What the core reads of its configuration (:class:`CoreConfig`, or a
    :class:`kvpush.ProducerConfig` itself): the consumer core's :class:`Settings` in shape."""

    @property
    def lease_s(self) -> float: ...
    @property
    def max_wait_s(self) -> float: ...
    @property
    def transfer_timeout_s(self) -> float: ...
    @property
    def tombstone_s(self) -> float: ...
    @property
    def coalesce(self) -> bool: ...
    @property
    def peer_timeout_s(self) -> float: ...


@dataclass(frozen=True)
class CoreConfig:
    """The settings of :class:`kvpush.ProducerConfig` that the core reads."""

    lease_s: float = 60.0
    max_wait_s: float = 600.0
    transfer_timeout_s: float = 30.0
    tombstone_s: float = 120.0
    coalesce: bool = True
    peer_timeout_s: float = 20.0


@dataclass
class _Write:
    key: int
    group: int
    nbytes: int
    nblocks: int
    deadline: _Timer


@dataclass
class _Owner:
    """One owner of a request: a consumer endpoint's use (peer, xid)."""

    peer: str
    xid: int
    mode: TransferMode
    state: OwnerState
    sharers: int
    sid: int = 0            # push: the source use its registration names (0: none)
    # push
    ids: np.ndarray | None = None
    part: int = 0
    groups: int = 1
    verify: bool = False
    tail: bool = False
    wait: _Timer | None = None
    plan: Any = None
    src: np.ndarray | None = None
    posted: set[int] = field(default_factory=set)
    writes: dict[int, _Write] = field(default_factory=dict)
    errored: list[int] = field(default_factory=list)
    unfenced: bool = False
    acked: bool = False      # the consumer's Abort came: it trusts nothing more of this use
    resend: _Timer | None = None  # fencing: when its Failed(unfenced) is said again
    # Its consumer was lost while a WRITE was in flight: "silent" (it may only be cut off)
    # or "dead" (peer_lost(abandon=True)). No Failed reaches it and no Abort will come.
    lost: str = ""
    # pull: when its PullBegin came, its size class (bit length of the source's blocks)
    # and, when its READ moves without this side's progress, the consumer's last such post's
    # time (PullBegin.inline_s; 0: not so)
    began: float = 0.0
    size: int = 0
    inline_s: float = 0.0
    # A push that will not complete ends (message to the consumer, release reason, detail)
    # once no WRITE of it is in flight; message "ack" | a Failed code | "" (peer gone).
    end: tuple[str, ReleaseReason, str] | None = None
    reason: ReleaseReason = ReleaseReason.TRANSFERRED   # how it ended (DONE/GONE)
    detail: str = ""
    hold: _Timer | None = None                          # pull: blocks held until then
    registered: float | None = None                     # push: when its Register came


@dataclass
class _Source:
    """One use of a request id's blocks. ``sid`` 0 from the engine (it does not name its
    uses) is replaced by a fresh one; ``named`` says the engine chose it."""

    ids: np.ndarray
    mode: TransferMode
    sid: int
    complete: bool
    layers: set[int] = field(default_factory=set)
    lease: _Timer | None = None
    stamps: dict[str, float] = field(default_factory=dict)
    named: bool = True

    def __post_init__(self) -> None:
        if not self.sid:
            self.sid, self.named = m.new_id(), False


@dataclass
class _Request:
    rid: str
    state: State
    source: _Source | None = None
    owners: dict[tuple[str, int], _Owner] = field(default_factory=dict)
    sharers: int | None = None
    ending: tuple[ReleaseReason, str] | None = None     # ENDING: the release to make
    code: str = ""                                      # ENDED/ABORTED_EARLY: Failed code
    why: str = ""
    done_owners: set[tuple[str, int]] = field(default_factory=set)
    tomb: _Timer | None = None
    unsafe: bool = False    # a transfer may still read the source when it is released
    # RELEASED_EARLY: the record stays max_wait_s past its tombstone for a prefill_done
    # that comes that late (a layer-wise prefill outlives its registration's wait)
    extended: bool = False
    # The engine aborted this use: its prefill_done, even one made after the abort, is
    # still this use's (it never starts a new use here).
    aborted: bool = False
    # ABORTED_EARLY: the use the engine's abort named (0: it named none, so the next use
    # whatever its sid)
    abort_sid: int = 0
    # The engine's sid of the last use of this id that ended or was released (0: unnamed),
    # set with ``released`` and kept past the next use's start: an abort naming it is late,
    # never for the use that comes next.
    ended_sid: int = 0
    released: tuple[int, np.ndarray] | None = None      # (sid, blocks) of the use released
    # Registrations (and push claims) of the next use of this id from endpoints that took
    # their place as owners of the live one already: (peer, message, when it came). They wait for
    # the live use's release, then start the next use.
    queued: list[tuple[str, m.Register | m.Claim, float]] = field(default_factory=list)
    # (peer, xid) -> (code, reason) of every Failed sent about this id, kept across its
    # uses for as long as the record: a consumer gives its blocks back on a Failed, so
    # nothing under that xid may be served after it (a registration sent before the Failed
    # arrived may come after a new use of the id began).
    failed: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)

    def live(self) -> list[_Owner]:
        return [s for s in self.owners.values() if s.state in _LIVE]


def _cancel(timer: _Timer | None) -> None:
    if timer is not None:
        timer.cancel()


class ProducerCore:
    """The producer's per-request logic. Not thread-safe: one caller (the loop) at a time.

    ``stats`` counts what happened (the driver's: ``Producer.stats()``), as the consumer
    core counts into its own.
    """

    def __init__(self, layout: KVLayout, config: Settings, links: Links,
                 stats: Stats | None = None) -> None:
        self.layout = layout
        self.config = config
        self.links = links
        self.stats = stats if stats is not None else Stats()
        self._requests: dict[str, _Request] = {}
        self._waiting: dict[str, int] = {}       # REGISTERED/CLAIMED owners by peer
        self._waiting_ids: dict[str, int] = {}   # their block ids (REGISTERED) by peer
        self._pulls: dict[int, _Owner] = {}      # PULLING owners, by id()
        # PullBegin to PullDone, by size class: when to poll for the next PullDone
        self._landings = Landings()
        self._since: float | None = None         # the driver's last look for notifications
        #: Gauges for :data:`kvpush.metrics.LIVE` (the facade publishes their changes).
        self.gauges = {"sources_held": 0, "registrations_waiting": 0}
        self._writes: dict[int, tuple[str, tuple[str, int]]] = {}   # key -> (rid, owner)
        self._peers: dict[str, KVLayout] = {}
        self._lost: dict[str, str] = {}          # lost peers with WRITEs still in flight
        # How long WRITEs to each consumer take when they end inside their post, by size
        # class (bit length of the bytes): Posted.inline_s.
        self._inline = PostTimes()
        self._keys = itertools.count(1)
        self._timers = TimerHeap()
        self._expire_tomb_fn = self._expire_tomb   # one bound method for every tombstone
        self._out: list[Effect] = []
        self._now = 0.0
        self._event: Event | None = None   # the event being run (owner changes name it)

    # -- the driver's side -------------------------------------------------------------------
    def drain(self) -> list[Effect]:
        out, self._out = self._out, []
        return out

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def tick(self, now: float) -> None:
        self._now = now
        for fn in self._timers.pop_due(now):
            fn(now)

    def in_flight(self) -> int:
        return len(self._writes)

    def wants_notifications(self) -> bool:
        """True while a READ of this side's blocks may be in flight (its PullDone
        notification is awaited): the driver reads NIXL's notifications."""
        return bool(self._pulls)

    def quiet_until(self, now: float) -> float | None:
        """Until when the driver need not poll NIXL for a PullDone (see
        :meth:`Landings.quiet_until`: every READ in flight was begun ``inline_s``)."""
        return self._landings.quiet_until(
            now, ((o.size, o.began, o.inline_s) for o in self._pulls.values()))

    def predicted(self, now: float, spin_s: float) -> tuple[float, float] | None:
        """The earliest predicted PullDone of a READ in flight: from the smoothed
        PullBegin-to-PullDone time of its size class."""
        return self._landings.window(
            now, spin_s, ((o.size, o.began, o.inline_s) for o in self._pulls.values()))

    def snapshot(self, rid: str) -> RequestStatus:
        """``rid``'s state here, as a typed snapshot (see :class:`kvpush.RequestStatus`)."""
        req = self._requests.get(rid)
        if req is None:
            return RequestStatus(rid, "none")
        src = req.source
        owners = list(req.owners.values())
        done = {(s.peer, s.xid) for s in owners if s.state is OwnerState.DONE}
        deadline = None
        if src is not None and src.lease is not None and not src.lease.cancelled:
            deadline = src.lease.deadline
        else:
            waits = [s.wait.deadline for s in owners if s.wait is not None
                     and not s.wait.cancelled]
            deadline = min(waits) if waits else None
        return RequestStatus(
            rid, req.state.value, src.mode if src is not None else None, 0,
            src.sid if src is not None else 0,
            src.ids if src is not None else np.empty(0, dtype=np.int64),
            max(len(owners), len(done | req.done_owners)), len(done | req.done_owners),
            deadline, 0, tuple(OwnerStatus(s.peer, s.xid, s.mode, s.state.value)
                               for s in owners))

    def held(self) -> int:
        """Requests whose source blocks are held (not released yet)."""
        return self.gauges["sources_held"]

    def debug_state(self, rid: str) -> str:
        """Where ``rid`` is, in a word (for tests and logs): writing, pulling, registered,
        held-push, held-pull, ending, partial, or none (unknown or ended)."""
        req = self._requests.get(rid)
        if req is None or (req.source is None and req.state is not State.WAITING):
            return "none"
        states = {s.state for s in req.owners.values()}
        if OwnerState.WRITING in states:
            return "writing"
        if OwnerState.PULLING in states:
            return "pulling"
        if OwnerState.REGISTERED in states:
            return "registered"
        if req.state is State.WAITING and OwnerState.CLAIMED in states:
            return "claimed"
        if req.state is State.WAITING:
            return "none"   # its owners gave up: remembered for a late prefill_done
        if req.state is State.HELD:
            assert req.source is not None
            return "held-" + str(req.source.mode.value)
        return str(req.state.value)

    def records(self) -> int:
        return len(self._requests)

    # -- engine events -----------------------------------------------------------------------
    def prefill_done(self, now: float, rid: str, ids: np.ndarray, mode: TransferMode,
                     sid: int, called: float | None = None) -> None:
        self._now = now
        stamps = {"prefill_done": now if called is None else called, "held": now}
        self._dispatch(rid, Event.PREFILL_DONE, (ids, mode, sid, stamps), new=True)

    def layer_done(self, now: float, rid: str, ids: np.ndarray, layer: int,
                   sid: int) -> None:
        self._now = now
        self._dispatch(rid, Event.LAYER_DONE, (ids, layer, sid), new=True)

    def abort(self, now: float, rid: str, reason: str, sid: int = 0) -> None:
        """The engine gives up ``rid``'s use ``sid`` (0: whichever use is live, or the next
        one when none is). A named abort reaches only that use: the live one when it is
        that use, else the next one unless that use already ended here (late: ignored)."""
        self._now = now
        self.stats.requests_aborted += 1
        req = self._requests.get(rid)
        if req is None:  # no use here yet: the next prefill_done is aborted
            req = self._new(rid, State.ABORTED_EARLY)
            req.abort_sid = sid
            self._tomb(req, "aborted", reason, state=State.ABORTED_EARLY)
            return
        if sid and not self._abort_names_live_or_next(req, sid):
            self.stats.events_refused += 1
            log.debug("abort of %r use %x: not the live use, nor the next", rid, sid)
            return
        self._dispatch(rid, Event.ENGINE_ABORT, (reason, sid))

    @staticmethod
    def _abort_names_live_or_next(req: _Request, sid: int) -> bool:
        """Whether an abort naming use ``sid`` is for ``req``'s live use, or (none live)
        for the use to come; an abort of a use that ended, or of another than the live
        one, changes nothing."""
        if req.source is not None:               # PARTIAL, HELD, ENDING
            return req.source.named and req.source.sid == sid
        if req.state is State.RELEASED_EARLY:    # its prefill_done is still to come
            return req.released is not None and req.released[0] == sid
        if req.state is State.ABORTED_EARLY:     # a repeat, or another use: the first holds
            return False
        return sid != req.ended_sid              # WAITING, ENDED

    def close(self, now: float) -> None:
        """Release every held source CLOSED (the driver releases NIXL handles itself)."""
        self._now = now
        self._event = Event.CLOSE
        for req in list(self._requests.values()):
            req.queued = []
            for owner in req.owners.values():
                # A WRITE in flight (its handle is released, not stopped), a READ inside
                # the hold its PullHeld promised, an abandoned WRITE not acknowledged: the
                # engine must keep the blocks unchanged a while (Release.blocks_safe).
                req.unsafe |= owner.state in _READING
                _cancel(owner.wait)
                _cancel(owner.hold)
                _cancel(owner.resend)
                for w in owner.writes.values():
                    w.deadline.cancel()
                owner.writes.clear()
                self._to(owner, OwnerState.GONE)
            if req.source is not None and req.state in (State.PARTIAL, State.HELD,
                                                          State.ENDING):
                self._release(req, ReleaseReason.CLOSED, "producer closed")
        self._requests.clear()
        self._writes.clear()
        self._timers.clear()
        self._event = None

    # -- network events ----------------------------------------------------------------------
    def peer_up(self, now: float, peer: str, layout: KVLayout) -> None:
        self._now = now
        self._peers[peer] = layout
        self._lost.pop(peer, None)

    def peer_lost(self, now: float, peer: str, why: str, *, abandon: bool = False) -> None:
        """``peer`` is gone (silent, said Bye, or NIXL says it is disconnected). Its waiting
        registrations and claims end; its WRITEs are left to end and its READs keep the
        blocks held until their hold deadline: a silent peer may only be stalled, and a READ
        is one-sided. ``abandon``: the peer is known dead (NIXL says so, or a new
        incarnation replaced it): its WRITEs are given up and its READs end at once."""
        self._now = now
        self._peers.pop(peer, None)
        self._inline.forget(peer)
        for req in list(self._requests.values()):
            if req.owners or req.queued or req.state in _SETTLES:
                self._internal(req, Event.PEER_LOST, peer, why, abandon)
        if any(who[0] == peer for _, who in self._writes.values()):
            self._lost[peer] = why       # DropPeer once its WRITEs have ended
        else:
            self._out.append(DropPeer(peer, why))

    def on_message(self, now: float, peer: str, msg: m.Message) -> None:
        """A decoded control frame from connected consumer ``peer``."""
        self._now = now
        if isinstance(msg, m.Register):
            self._dispatch(msg.request_id, Event.REGISTER, (peer, msg), new=True,
                           refuse=lambda req: self._fail(peer, msg.request_id, msg.xid,
                                                         *self._refusal(req)))
        elif isinstance(msg, m.Claim):
            self._dispatch(msg.request_id, Event.CLAIM, (peer, msg), new=msg.push,
                           refuse=lambda req: self._fail(peer, msg.request_id, msg.xid,
                                                         *self._refusal(req)))
        elif isinstance(msg, m.PullBegin):
            self._dispatch(msg.request_id, Event.PULL_BEGIN, (peer, msg),
                           refuse=lambda req: self._pull_refused(req, peer, msg))
        elif isinstance(msg, m.PullDone):
            self.on_notification(now, peer, msg)
        elif isinstance(msg, m.Abort):
            self._dispatch(msg.request_id, Event.CONSUMER_ABORT, (peer, msg),
                           refuse=lambda req: self._send(peer, m.AbortAck(msg.request_id,
                                                                          msg.xid)))
        else:
            self.stats.messages_rejected += 1

    def on_notification(self, now: float, peer: str, msg: m.Message,
                        since: float | None = None) -> None:
        """A decoded NIXL notification from ``peer`` (a READ's PullDone), read at ``now``
        (``since``: the driver's previous look, which did not find it)."""
        self._now = now
        if not isinstance(msg, m.PullDone):
            self.stats.messages_rejected += 1
            return
        self._since = since
        self._dispatch(msg.request_id, Event.PULL_DONE, (peer, msg),
                       refuse=lambda req: self._stale(msg))

    def transfer_ended(self, now: float, key: int, end: XferEnd,
                       inline_s: float = 0.0) -> None:
        """WRITE ``key`` ended (or was abandoned, or NIXL refused its post). ``inline_s``:
        it had ended by the time its post returned, which took that long."""
        self._now = now
        entry = self._writes.pop(key, None)
        if entry is None:
            return
        rid, who = entry
        req = self._requests[rid]
        owner = req.owners[who]
        write = next(w for w in owner.writes.values() if w.key == key)
        if end is XferEnd.DONE and owner.peer in self._peers:
            self._inline.ended(owner.peer, write.nbytes.bit_length(), inline_s)
        self._internal(req, Event.WRITE_ENDED, owner, write, end)
        if owner.peer in self._lost and not any(
                o[0] == owner.peer for _, o in self._writes.values()):
            self._out.append(DropPeer(owner.peer, self._lost.pop(owner.peer)))

    def _on_peer_lost(self, req: _Request, peer: str, why: str, abandon: bool) -> None:
        self._unqueue(req, lambda p, xid: p == peer)
        for owner in list(req.owners.values()):
            if owner.peer != peer or owner.state not in _LIVE:
                continue
            if owner.state in (OwnerState.REGISTERED, OwnerState.CLAIMED):
                self._owner_gone(req, owner, ReleaseReason.FAILED, f"consumer lost: {why}")
            elif owner.state is OwnerState.WRITING:
                owner.lost = "dead" if abandon else "silent"
                self._end_push(req, owner, "", ReleaseReason.FAILED,
                               f"consumer lost: {why}")
                if abandon:
                    for write in list(owner.writes.values()):
                        self._out.append(Abandon(write.key))
                self._conclude(req, owner)
            elif owner.state is OwnerState.FENCING:
                # Never acknowledged the unfenced Failed: if it was only cut off, its
                # late WRITE may still read the blocks.
                req.unsafe = not abandon
                self._owner_gone(req, owner, owner.reason, owner.detail)
            elif abandon:  # a new incarnation replaced it: its READs died with it
                self._owner_gone(req, owner, ReleaseReason.FAILED, f"consumer lost: {why}")
            # else PULLING: a silent peer may only be stalled; its hold timer ends it

    def _on_write_ended(self, req: _Request, owner: _Owner, write: _Write,
                        end: XferEnd) -> None:
        del owner.writes[write.group]
        write.deadline.cancel()
        if req.source is not None:
            req.source.stamps["written"] = self._now
        if end is XferEnd.DONE:
            self.stats.blocks_moved += write.nblocks if write.group == 0 else 0
            self.stats.bytes_moved += write.nbytes
        else:
            if end is XferEnd.ABANDONED:
                owner.unfenced = True
                self.stats.transfers_abandoned += 1
            else:  # in error, refused or lost: nothing more of it lands
                owner.errored.append(owner.part * owner.groups + write.group)
            if owner.end is None:
                code = "timeout" if end is XferEnd.ABANDONED else (
                    "peer_unavailable" if end is XferEnd.LOST else "transfer_failed")
                self.stats.requests_timed_out += end is XferEnd.ABANDONED
                self._end_push(req, owner, code, ReleaseReason.FAILED, f"WRITE {code}")
        self._conclude(req, owner)

    # -- dispatch ----------------------------------------------------------------------------
    def _new(self, rid: str, state: State) -> _Request:
        req = _Request(rid, state)
        self._requests[rid] = req
        return req

    def _dispatch(self, rid: str, event: Event, args: tuple[Any, ...], *, new: bool = False,
                  refuse: Callable[[_Request | None], None] | None = None) -> None:
        """An engine or consumer event: refused (counted, logged, ``refuse`` answers the
        consumer) when ``rid``'s state has no row for it; ``new``: a record is made
        (WAITING) when there is none."""
        req = self._requests.get(rid)
        if req is None and new:
            req = self._new(rid, State.WAITING)
        r = None if req is None else TABLE.row(req.state, event)
        if r is None:
            self.stats.events_refused += 1
            log.debug("refused %s for %r in state %s", event.value, rid,
                      "none" if req is None else req.state.value)
            if refuse is not None:
                refuse(req)
            return
        assert req is not None
        self._run(req, event, r, args)

    def _internal(self, req: _Request, event: Event, *args: Any, settle: bool = True) -> None:
        """A timer, a transfer's end or a lost peer: its row must exist (the core keeps
        nothing that such an event could find in a state without one)."""
        r = TABLE.row(req.state, event)
        if r is None:
            TABLE.check(req.state, event, req.state)   # raises: no row
            return
        self._run(req, event, r, args, settle)

    def _run(self, req: _Request, event: Event, r: Row[State], args: tuple[Any, ...],
             settle: bool = True) -> None:
        """Run a row's handler and check where it went; then settle the request (its
        state's ``release`` row) and check that too."""
        before, outer = req.state, self._event
        self._event = event
        try:
            if r.handler is not None:
                getattr(self, r.handler)(req, *args)
            if req.state not in r.to:
                TABLE.check(before, event, req.state)
            if settle:
                mid = req.state
                settled = TABLE.row(mid, Event.RELEASE)
                if settled is not None:
                    self._settle(req)
                    if req.state not in settled.to:
                        TABLE.check(mid, Event.RELEASE, req.state)
        finally:
            self._event = outer

    def _refusal(self, req: _Request | None) -> tuple[str, str]:
        if req is None:
            return "not_held", "the producer does not hold this request's blocks"
        if req.state in (State.ENDED, State.ABORTED_EARLY, State.RELEASED_EARLY):
            if not req.code:
                return "not_held", "the producer does not hold this request's blocks"
            return req.code, req.why
        if req.state is State.ENDING:
            assert req.ending is not None
            return ("aborted" if req.ending[0] is ReleaseReason.ABORTED else "failed",
                    req.ending[1])
        return "not_held", f"the request is {req.state.value} here"

    def _stale(self, msg: m.PullDone) -> None:
        self.stats.stale_messages += 1

    def _to(self, owner: _Owner, state: OwnerState, event: Event | None = None, *,
            created: bool = False) -> None:
        """Every owner state change goes through here: it is checked against
        :data:`OWNER_TABLE` (``event``: the event being run, unless named), and it keeps
        the counters. ``created``: a new owner enters its first state."""
        old = owner.state
        if old is state and not created:
            return
        if created:
            old = OwnerState.GONE
        else:
            event = event or self._event
            r = None if event is None else OWNER_TABLE.row(old, event)
            if r is None or state not in r.to:
                if event is None:
                    raise TransitionError(f"producer owner: {old.name} -> {state.name} "
                                          "outside any event")
                OWNER_TABLE.check(old, event, state)
        if old in (OwnerState.REGISTERED, OwnerState.CLAIMED):
            self._waiting[owner.peer] -= 1
            if not self._waiting[owner.peer]:
                del self._waiting[owner.peer]
        if state in (OwnerState.REGISTERED, OwnerState.CLAIMED):
            self._waiting[owner.peer] = self._waiting.get(owner.peer, 0) + 1
        if OwnerState.REGISTERED in (old, state) and owner.ids is not None:
            n = len(owner.ids) if state is OwnerState.REGISTERED else -len(owner.ids)
            held = self._waiting_ids.get(owner.peer, 0) + n
            if held:
                self._waiting_ids[owner.peer] = held
            else:
                self._waiting_ids.pop(owner.peer, None)
        if state is OwnerState.PULLING:
            self._pulls[id(owner)] = owner
        elif old is OwnerState.PULLING:
            del self._pulls[id(owner)]
        self.gauges["registrations_waiting"] += (state is OwnerState.REGISTERED) - (
            old is OwnerState.REGISTERED)
        owner.state = state

    def _add_owner(self, req: _Request, owner: _Owner) -> None:
        # A retry takes the place of its endpoint's owner given up (see _admit).
        for key in [k for k, s in req.owners.items() if s.peer == owner.peer]:
            del req.owners[key]
        req.owners[(owner.peer, owner.xid)] = owner
        req.sharers = owner.sharers
        self._to(owner, owner.state, created=True)

    # -- engine event handlers ---------------------------------------------------------------
    def _on_prefill_done(self, req: _Request, ids: np.ndarray, mode: TransferMode, sid: int,
                         stamps: dict[str, float]) -> None:
        if req.state is State.ABORTED_EARLY and self._not_aborted_use(req, sid):
            self._reuse(req)
        state = req.state
        if state is State.ABORTED_EARLY:
            req.state = State.ENDED   # this use is settled; the id is free after its tomb
            req.ended_sid = sid
            if mode is TransferMode.PULL:
                # A ticket for these blocks is out: a READ may start at any moment until
                # its lease ends, so the blocks stay held (ENDING) until then.
                _cancel(req.tomb)
                req.source = _Source(ids, mode, sid, True, stamps=stamps)
                self.gauges["sources_held"] += 1
                req.ending = (ReleaseReason.ABORTED, req.why)
                req.state = State.ENDING
                req.source.lease = self._after(self.config.lease_s,
                                               self._lease_expired_fn(req))
                return
            self._out.append(Emit(Release(req.rid, ReleaseReason.ABORTED, ids, req.why,
                                          {**stamps, "released": self._now},
                                          sid or m.new_id(), mode=mode)))
            self.stats.blocks_released += len(ids)
            return
        if state is State.RELEASED_EARLY and self._same_use(req, ids, sid):
            # The prefill_done of the use released already (early or aborted), whenever it
            # comes: swallowed. Deciding by the time it came took a late one (a prefill
            # that outlived tombstone_s, or one the engine made after its abort) for a new
            # use, whose blocks were held again and released a second time.
            req.state = State.ENDED
            self._tomb(req, req.code, req.why)
            return
        if state is State.RELEASED_EARLY:  # another use's blocks: a new use
            self._reuse(req)
            state = req.state
        if state is State.ENDED:
            self._reuse(req)
            state = req.state
        if state in (State.HELD, State.ENDING):
            assert req.source is not None
            if not req.source.complete and np.array_equal(ids, req.source.ids):
                # An aborted layer-wise use's own prefill_done, while its WRITEs end.
                req.source.complete = True
                req.source.stamps.update(stamps)
                return
            # The same blocks twice are held once (and released once); blocks this use
            # does not hold go back at once.
            extra = np.setdiff1d(ids, req.source.ids)
            log.warning("prefill_done for %r twice; %d block(s) not held are released",
                        req.rid, len(extra))
            self.stats.events_refused += 1
            if len(extra):
                self._out.append(Emit(Release(req.rid, ReleaseReason.FAILED, extra,
                                              "duplicate prefill_done", sid=sid,
                                              mode=mode)))
            return
        if state is State.PARTIAL:
            assert req.source is not None
            if mode is not TransferMode.PUSH or not np.array_equal(req.source.ids, ids):
                log.warning("prefill_done for %r names other blocks than its layer_done "
                            "calls; released as FAILED", req.rid)
                self.stats.events_refused += 1
                self._out.append(Emit(Release(req.rid, ReleaseReason.FAILED,
                                              np.setdiff1d(ids, req.source.ids),
                                              "prefill_done does not match layer_done",
                                              sid=sid, mode=mode)))
                ids = req.source.ids
            req.source.complete = True
            req.source.stamps.update(stamps)
        else:  # WAITING
            _cancel(req.tomb)
            came = [s.registered for s in req.live() if s.registered is not None]
            if came and mode is TransferMode.PUSH:  # registered before prefill_done
                stamps["registered"] = min(came)
            req.source = _Source(ids, mode, sid, True, stamps=stamps)
            self.gauges["sources_held"] += 1
            if mode is TransferMode.PULL:  # push registrations cannot be served
                for owner in req.live():
                    self._fail(owner.peer, req.rid, owner.xid, "mode_conflict",
                               "the producer exposed this request for pull")
                    self._owner_gone(req, owner, ReleaseReason.FAILED, "mode conflict")
                req.owners, req.sharers = {}, None
            self._refuse_other_uses(req)
        req.state = State.HELD
        req.source.lease = self._after(self.config.lease_s, self._lease_expired_fn(req))
        self._advance(req)

    def _refuse_other_uses(self, req: _Request) -> None:
        """The source use has come: registrations waiting for it that name another (an
        earlier use's, late) are told the truth, and take nothing of it."""
        source = req.source
        assert source is not None
        for owner in req.live():
            if owner.sid and (not source.named or owner.sid != source.sid):
                self._fail(owner.peer, req.rid, owner.xid, "not_held",
                           "the producer holds another use of this request")
                self._owner_gone(req, owner, ReleaseReason.FAILED, "another use")

    @staticmethod
    def _not_aborted_use(req: _Request, sid: int) -> bool:
        """Whether an engine call naming ``sid`` is of another use than the one an abort
        named before it came (both named): that use starts as any new use."""
        return bool(req.abort_sid and sid and sid != req.abort_sid)

    @staticmethod
    def _same_use(req: _Request, ids: np.ndarray, sid: int) -> bool:
        """Whether an engine call naming ``ids`` and ``sid`` is of the use released early:
        the same source use id when both calls name one (``sid`` non-zero), else (an
        engine that does not name its uses) the same blocks."""
        if req.released is None:
            return True
        if sid and req.released[0]:
            return sid == req.released[0]
        return np.array_equal(ids, req.released[1])

    def _on_layer_done(self, req: _Request, ids: np.ndarray, layer: int, sid: int) -> None:
        if req.state is State.RELEASED_EARLY:
            return  # swallowed: prefill_done settles the use
        if req.state is State.ABORTED_EARLY and self._not_aborted_use(req, sid):
            self._reuse(req)
        if req.state is State.ABORTED_EARLY:
            # A layer of a use the engine aborted before its prefill ended (or of a use of
            # the id begun while that abort's tombstone stands: its registrations were
            # refused). Nothing will read these blocks, so they go back now, once; the
            # use's later layer_done and prefill_done are swallowed as a use released
            # early. Swallowing this one instead left the blocks with nobody when the
            # engine aborted again rather than calling prefill_done. A layer after the
            # abort says the engine is still prefilling this use: the record waits for
            # its prefill_done as for any use released early (max_wait_s past the
            # tombstone), or a late one would be taken for a new use and these blocks,
            # the engine's again, held and released a second time.
            self._out.append(Emit(Release(req.rid, ReleaseReason.ABORTED, ids, req.why,
                                          {"released": self._now}, sid or m.new_id(),
                                          mode=TransferMode.PUSH)))
            self.stats.blocks_released += len(ids)
            req.released, req.ended_sid, req.aborted = (sid, ids), sid, False
            req.state = State.RELEASED_EARLY
            return
        if req.state is State.ENDED:
            self._reuse(req)
        if req.state is State.WAITING:
            req.source = _Source(ids, TransferMode.PUSH, sid, False,
                                 stamps={"held": self._now})
            self.gauges["sources_held"] += 1
            req.state = State.PARTIAL
            self._refuse_other_uses(req)
        assert req.source is not None
        if not np.array_equal(req.source.ids, ids):
            log.warning("layer_done(%r, %d) names other blocks than before; ignored",
                        req.rid, layer)
            self.stats.events_refused += 1
            return
        req.source.layers.add(layer)
        self._advance(req)

    def _on_engine_abort(self, req: _Request, reason: str, sid: int) -> None:
        if req.state is State.ENDED:
            if not sid:   # which use it means cannot be told: the one that ended
                self.stats.events_refused += 1
                return
            self._reuse(req)   # the use it names is still to come
        req.aborted = True
        if req.state is State.RELEASED_EARLY:
            # The engine ends this use instead of (or before) calling prefill_done: the
            # use stays released, a prefill_done it still makes is this use's (not a new
            # use held and released again), and the record goes tombstone_s from now.
            self._tomb(req, req.code, req.why, state=State.RELEASED_EARLY)
            return
        if req.state is State.WAITING:
            for owner in req.live():
                self._fail(owner.peer, req.rid, owner.xid, "aborted", reason)
                self._owner_gone(req, owner, ReleaseReason.ABORTED, reason)
            req.owners, req.sharers = {}, None
            req.abort_sid = sid
            self._tomb(req, "aborted", reason, state=State.ABORTED_EARLY)
            return
        self._give_up(req, ReleaseReason.ABORTED, reason, code="aborted")

    # -- consumer event handlers -------------------------------------------------------------
    def _admit(self, req: _Request, peer: str, xid: int, sharers: int, *,
               next_use: bool = False) -> str:
        """Whether (peer, xid) may become an owner of ``req``'s live use: "" or a Failed code.

        Each consumer endpoint is at most one owner of one use. An endpoint whose owner
        ended without the data (it gave up, timed out, failed) may take it again under a
        new xid: that is its engine's retry of the same use, and it replaces the owner
        given up. An endpoint whose owner was served has no second one: a new xid from it
        is a use to come ("next_use" when ``next_use``, else "not_owner"), never an owner
        of this one (it got this use's bytes, and the genuine owner the next use's)."""
        if not 1 <= sharers <= m.MAX_SHARERS:
            return "sharers"
        if (peer, xid) in req.owners:
            return "duplicate"
        mine = [s for s in req.owners.values() if s.peer == peer]
        if any(s.state in _LIVE for s in mine):
            return "duplicate"
        if any(s.state is OwnerState.DONE for s in mine):
            return "next_use" if next_use else "not_owner"
        if req.sharers is not None and sharers != req.sharers:
            return "sharers"
        if len(req.owners) - len(mine) >= sharers:
            return "not_owner"
        if self._waiting.get(peer, 0) >= MAX_WAITING_PER_PEER:
            return "too_many"
        return ""

    def _ids_refused(self, peer: str, n: int) -> tuple[str, str] | None:
        """Why a registration of ``n`` block ids from ``peer`` is refused, if it is: more
        than one request can name (a request's blocks on either side: this side's cache, in
        the consumer's blocks, and the consumer's), or more ids than ``peer`` may have
        waiting here (:data:`MAX_IDS_PER_PEER`)."""
        theirs = self._peers.get(peer)
        if theirs is None:
            return None
        ours = -(-self.layout.num_blocks * self.layout.tokens_per_block
                 // theirs.tokens_per_block)
        most = min(ours, theirs.num_blocks)
        if n > most:
            return "invalid_ids", f"{n} block ids; a request here names at most {most}"
        budget = waiting_ids_budget(theirs.num_blocks)
        if self._waiting_ids.get(peer, 0) + n > budget:
            return "too_many", (f"more than {budget} block ids waiting from this consumer "
                                f"({n} more asked)")
        return None

    _ADMIT_REASON = {
        "sharers": "the number of sharers differs from the other owners' (or is out of range)",
        "duplicate": "this consumer already has this request registered",
        "not_owner": "every owner of this request (sharers) is there already",
        "too_many": "too many requests waiting from this consumer",
        "next_use": "this consumer was an owner of the live use already",
    }

    def _push_owner(self, req: _Request, peer: str, msg: m.Register | m.Claim) -> bool:
        """Whether (peer, msg.xid) may become a push owner of ``req`` (a registration or a
        push claim); if not, the consumer is told why, or -- a registration of the next
        use while this one is held -- it waits for this use's release. An ended use that
        went well makes way for a new one; one that ended badly answers its code."""
        xid, sharers, sid = msg.xid, msg.sharers, msg.sid
        if self._failed_before(req, peer, xid):
            return False
        if req.state is State.ENDED:
            if req.code and not (sid and (req.released is None or req.released[0] != sid)):
                # late: a use that ended badly (a registration naming another use is for
                # a new one)
                self._fail(peer, req.rid, xid, *self._refusal(req))
                return False
            self._reuse(req)
        if req.source is not None and req.source.mode is TransferMode.PULL:
            self._fail(peer, req.rid, xid, "mode_conflict",
                       "the producer exposed this request for pull")
            return False
        source = req.source
        other = sid and source is not None and (not source.named or source.sid != sid)
        code = "next_use" if other else self._admit(req, peer, xid, sharers, next_use=True)
        if code == "next_use" and req.state is State.HELD \
                and len(req.queued) < m.MAX_SHARERS:
            req.queued.append((peer, msg, self._now))
            return False
        if other:
            self._fail(peer, req.rid, xid, "not_held",
                       "the producer holds another use of this request")
            return False
        if code:
            self._fail(peer, req.rid, xid, code, self._ADMIT_REASON[code])
            return False
        return True

    def _on_register(self, req: _Request, peer: str, msg: m.Register) -> None:
        rid = req.rid
        claimed = req.owners.get((peer, msg.xid))
        if claimed is not None and claimed.mode is TransferMode.PUSH \
                and claimed.state is OwnerState.CLAIMED:
            # The registration of a push claim: the claim's place is this registration's.
            self._owner_gone(req, claimed, ReleaseReason.ABORTED, "registered")
            del req.owners[(peer, msg.xid)]
        if not self._push_owner(req, peer, msg):
            return
        layers = self.layout.num_layers
        if msg.groups != 1 and (msg.groups != layers or self.layout.layers_per_region != 1):
            self._fail(peer, rid, msg.xid, "invalid_groups",
                       f"{msg.groups} layer groups requested; this producer writes 1 or "
                       f"{layers} (one per layer)")
            return
        if not 0 <= msg.part < MAX_PARTS:
            self._fail(peer, rid, msg.xid, "invalid_part", f"part {msg.part} out of range")
            return
        try:
            ids = m.decode_ids(msg.block_ids)
        except KvpushError as exc:
            self._fail(peer, rid, msg.xid, "invalid_ids", str(exc))
            return
        refused = self._ids_refused(peer, len(ids))
        if refused is not None:
            self._fail(peer, rid, msg.xid, *refused)
            return
        wait = min(max(msg.wait_s, 0.0), self.config.max_wait_s) \
            if math.isfinite(msg.wait_s) else self.config.max_wait_s
        owner = _Owner(peer, msg.xid, TransferMode.PUSH, OwnerState.REGISTERED, msg.sharers,
                       msg.sid, ids=ids, part=msg.part, groups=msg.groups, verify=msg.verify,
                       tail=msg.tail, registered=self._now)
        who = (peer, msg.xid)
        owner.wait = self._after(wait, lambda now: self._wait_expired(rid, who))
        self._add_owner(req, owner)
        if req.source is not None:
            req.source.stamps.setdefault("registered", self._now)
        self._advance(req)

    def _on_claim(self, req: _Request, peer: str, msg: m.Claim) -> None:
        if msg.push:
            self._on_push_claim(req, peer, msg)
            return
        if self._failed_before(req, peer, msg.xid):
            return
        if req.state is not State.HELD:  # a pull claim needs the ticket's source
            self.stats.events_refused += 1
            self._fail(peer, req.rid, msg.xid, *self._refusal(req))
            return
        source = req.source
        if source is None or source.sid != msg.sid or source.mode is not TransferMode.PULL:
            self._fail(peer, req.rid, msg.xid, "not_held",
                       "the producer does not hold this ticket's blocks")
            return
        code = self._admit(req, peer, msg.xid, msg.sharers)
        if code:
            self._fail(peer, req.rid, msg.xid, code, self._ADMIT_REASON[code])
            return
        who = (peer, msg.xid)
        owner = _Owner(peer, msg.xid, TransferMode.PULL, OwnerState.CLAIMED, msg.sharers)
        owner.wait = self._after(self.config.max_wait_s,
                                 lambda now: self._wait_expired(req.rid, who))
        self._add_owner(req, owner)

    def _on_push_claim(self, req: _Request, peer: str, msg: m.Claim) -> None:
        """A consumer will register later (its engine has no blocks yet): an owner that
        keeps the source past its lease until it registers, gives up, is lost, or
        ``max_wait_s`` ends; before prefill_done it holds nothing yet."""
        rid = req.rid
        if not self._push_owner(req, peer, msg):
            return
        who = (peer, msg.xid)
        owner = _Owner(peer, msg.xid, TransferMode.PUSH, OwnerState.CLAIMED, msg.sharers)
        owner.wait = self._after(self.config.max_wait_s,
                                 lambda now: self._wait_expired(rid, who))
        self._add_owner(req, owner)

    def _on_pull_begin(self, req: _Request, peer: str, msg: m.PullBegin) -> None:
        source = req.source
        who = (peer, msg.xid)
        owner = req.owners.get(who)
        if source is None or source.sid != msg.sid or source.mode is not TransferMode.PULL:
            self._pull_refused(req, peer, msg)
            return
        if owner is not None and owner.state is OwnerState.DONE:
            self._send(peer, m.PullHeld(req.rid, msg.xid, self._hold_s()))
            return  # its PullDone overtook this PullBegin: the READ ended while held
        if owner is not None and owner.state is not OwnerState.CLAIMED:
            self.stats.stale_messages += 1  # a duplicate
            return
        if owner is None:
            if self._failed_before(req, peer, msg.xid):
                return
            code = self._admit(req, peer, msg.xid, msg.sharers)
            if code:
                self._fail(peer, req.rid, msg.xid, code, self._ADMIT_REASON[code])
                return
            owner = _Owner(peer, msg.xid, TransferMode.PULL, OwnerState.CLAIMED, msg.sharers)
            self._add_owner(req, owner)
        _cancel(owner.wait)
        owner.began, owner.size, owner.inline_s = self._now, len(source.ids).bit_length(), \
            msg.inline_s
        self._to(owner, OwnerState.PULLING)
        source.stamps.setdefault("pull_begin", self._now)
        owner.hold = self._after(self._hold_s(), lambda now: self._hold_over(req.rid, who))
        if req.state is State.ENDING:
            self._fail(peer, req.rid, msg.xid, *self._refusal(req))
        else:
            self._send(peer, m.PullHeld(req.rid, msg.xid, self._hold_s()))

    def _pull_refused(self, req: _Request | None, peer: str, msg: m.PullBegin) -> None:
        if req is not None and (peer, msg.xid) in req.done_owners:
            self._send(peer, m.PullHeld(req.rid, msg.xid, self._hold_s()))
            return
        code, why = self._refusal(req)
        if req is not None and req.source is not None and req.source.sid != msg.sid:
            code, why = "not_held", "this ticket's blocks were released (the id was reused)"
        self._fail(peer, msg.request_id, msg.xid, code, why)

    def _on_pull_done(self, req: _Request, peer: str, msg: m.PullDone) -> None:
        source = req.source
        if source is None or source.sid != msg.sid:
            self._stale(msg)
            return
        who = (peer, msg.xid)
        owner = req.owners.get(who)
        if owner is None:
            # The READ's notification overtook its PullBegin (it rides NIXL, the PullBegin
            # ZeroMQ): the READ ended while the blocks were held. Remember the owner so
            # the late PullBegin gets its PullHeld.
            if self._admit(req, peer, msg.xid, msg.sharers):
                self._stale(msg)
                return
            owner = _Owner(peer, msg.xid, TransferMode.PULL, OwnerState.CLAIMED, msg.sharers)
            self._add_owner(req, owner)
        if owner.state not in (OwnerState.CLAIMED, OwnerState.PULLING):
            self._stale(msg)
            return
        if owner.state is OwnerState.PULLING:
            self._landings.learn(owner.size, owner.began, self._now, self._since)
        _cancel(owner.wait)
        _cancel(owner.hold)
        if req.state is State.ENDING or owner.end is not None:
            reason = owner.end[1] if owner.end else ReleaseReason.ABORTED
            self._owner_gone(req, owner, reason,
                             owner.detail or (req.ending[1] if req.ending else ""))
            return
        self._to(owner, OwnerState.DONE)
        owner.reason = ReleaseReason.TRANSFERRED
        req.done_owners.add(who)
        self.stats.requests_completed += 1
        self.stats.blocks_moved += len(source.ids)
        self.stats.bytes_moved += msg.nbytes

    def _on_consumer_abort(self, req: _Request, peer: str, msg: m.Abort) -> None:
        who = (peer, msg.xid)
        self._unqueue(req, lambda p, xid: (p, xid) == who)
        owner = req.owners.get(who)
        why = f"consumer: {msg.reason}"
        if owner is not None and owner.state is OwnerState.FENCING:
            # The acknowledgement: the consumer knows the WRITE is unfenced and will not
            # trust what it delivers; the blocks may go.
            self._owner_gone(req, owner, owner.reason, owner.detail)
            self._send(peer, m.AbortAck(req.rid, msg.xid, owner.errored, True))
            return
        if owner is None or owner.state not in _LIVE:
            self._send(peer, m.AbortAck(req.rid, msg.xid))  # nothing of it is in flight
            self.stats.stale_messages += owner is None
            return
        if owner.state is OwnerState.WRITING:
            owner.acked = True
            self._end_push(req, owner, "ack", ReleaseReason.ABORTED, why)
            self._conclude(req, owner)
            return
        if owner.state is OwnerState.PULLING:
            # Its READ may still run (and over TCP needs this side to progress): the owner
            # ends at its PullDone or its hold deadline.
            owner.end = ("", ReleaseReason.ABORTED, why)
            owner.detail = why
            self._send(peer, m.AbortAck(req.rid, msg.xid))
            return
        self._owner_gone(req, owner, ReleaseReason.ABORTED, why)
        self._send(peer, m.AbortAck(req.rid, msg.xid))

    @staticmethod
    def _unqueue(req: _Request, which: Callable[[str, int], bool]) -> None:
        """Forget the next use's registrations that ``which(peer, xid)`` names."""
        if req.queued:
            req.queued = [q for q in req.queued if not which(q[0], q[1].xid)]

    # -- timers ------------------------------------------------------------------------------
    def _after(self, delay: float, fn: Callable[[float], None]) -> _Timer:
        return self._timers.add(self._now + delay, fn)

    def _hold_s(self) -> float:
        return self.config.transfer_timeout_s

    def _lease_expired_fn(self, req: _Request) -> Callable[[float], None]:
        def fire(now: float) -> None:
            if self._requests.get(req.rid) is req:
                self._internal(req, Event.LEASE_OVER)
        return fire

    def _on_lease_over(self, req: _Request) -> None:
        """Nothing of its own: :meth:`_settle`, after it, releases a source whose lease is
        over and that no owner still keeps."""

    def _wait_expired(self, rid: str, who: tuple[str, int]) -> None:
        req = self._requests.get(rid)
        owner = req.owners.get(who) if req is not None else None
        if req is None or owner is None or owner.state not in _LIVE:
            return
        self._internal(req, Event.WAIT_OVER, owner)

    def _on_wait_over(self, req: _Request, owner: _Owner) -> None:
        rid = req.rid
        self.stats.requests_timed_out += 1
        if owner.state is OwnerState.WRITING:  # layer-wise: the last layers never came
            self._end_push(req, owner, "timeout", ReleaseReason.FAILED,
                           "prefill did not finish in time")
            self._conclude(req, owner)
        elif owner.state in (OwnerState.REGISTERED, OwnerState.CLAIMED):
            self._fail(owner.peer, rid, owner.xid, "timeout",
                       "prefill did not finish in time" if owner.state is OwnerState.REGISTERED
                       else "the claim was not taken within max_wait_s")
            # The owner stopped waiting (its deadline ends with this wait, and its own Abort
            # may come first or not): it gave up, whichever arrives first.
            self._owner_gone(req, owner, ReleaseReason.ABORTED, "registration expired")

    def _resend_later(self, owner: _Owner, failed: m.Failed) -> None:
        """Say a fencing owner's ``failed`` (unfenced) again in ``peer_timeout_s / 4``: the
        Abort that ends the fence can be lost with a TCP connection ZeroMQ replaces at
        once, so no peer loss ends it either; a consumer that gave the use up answers
        every such Failed with an Abort (and one still deciding takes it as a
        duplicate), so the fence ends at the next answer, not after ``max_wait_s``."""
        who = (owner.peer, owner.xid)
        owner.resend = self._after(self.config.peer_timeout_s / 4,
                                   lambda now: self._resend_fenced(who, failed))

    def _resend_fenced(self, who: tuple[str, int], failed: m.Failed) -> None:
        req = self._requests.get(failed.request_id)
        owner = req.owners.get(who) if req is not None else None
        if owner is None or owner.state is not OwnerState.FENCING:
            return
        self._send(owner.peer, failed)
        self._resend_later(owner, failed)

    def _fence_expired(self, rid: str, who: tuple[str, int]) -> None:
        req = self._requests.get(rid)
        owner = req.owners.get(who) if req is not None else None
        if req is None or owner is None or owner.state is not OwnerState.FENCING:
            return
        self._internal(req, Event.FENCE_OVER, owner)

    def _on_fence_over(self, req: _Request, owner: _Owner) -> None:
        req.unsafe = True
        self._owner_gone(req, owner, owner.reason, owner.detail)

    def _hold_over(self, rid: str, who: tuple[str, int]) -> None:
        req = self._requests.get(rid)
        owner = req.owners.get(who) if req is not None else None
        if req is None or owner is None or owner.state is not OwnerState.PULLING:
            return
        self._internal(req, Event.HOLD_OVER, owner)

    def _on_hold_over(self, req: _Request, owner: _Owner) -> None:
        self.stats.requests_timed_out += owner.end is None
        self._owner_gone(req, owner, owner.end[1] if owner.end else ReleaseReason.FAILED,
                         owner.detail or "the READ did not end within its hold")

    def _write_expired(self, rid: str, who: tuple[str, int], key: int) -> None:
        if key in self._writes:
            self._out.append(Abandon(key))

    # -- the rendezvous ----------------------------------------------------------------------
    def _advance(self, req: _Request) -> None:
        """Match push owners with the source and post every group that is final."""
        source = req.source
        if source is None or req.state not in (State.PARTIAL, State.HELD):
            return
        for owner in list(req.owners.values()):
            if owner.mode is not TransferMode.PUSH or owner.end is not None:
                continue
            wait = owner.wait
            if wait is not None and not wait.cancelled and wait.deadline <= self._now:
                # Its wait ran out before this event came (the loop was busy or stalled
                # past it), and its timer fires after the event. The consumer has given
                # the request up by then, and may reuse the blocks: a WRITE posted now
                # could land in another request's KV. The timer ends this owner.
                continue
            if owner.state is OwnerState.REGISTERED:
                if owner.groups == 1 and not source.complete:
                    continue  # whole-request push: wait for prefill_done
                if not self._match(req, owner):
                    continue
            if owner.state is OwnerState.WRITING:
                self._pump(req, owner)

    def _match(self, req: _Request, owner: _Owner) -> bool:
        source = req.source
        assert source is not None and owner.ids is not None
        src = source.ids
        if owner.tail and len(owner.ids) <= len(src):  # the consumer holds the prefix
            src = src[len(src) - len(owner.ids):]
        try:
            plan = self.links.plan(owner.peer, src, owner.ids, self.config.coalesce)
        except KvpushError as exc:
            self.stats.requests_failed += 1
            self._fail(owner.peer, req.rid, owner.xid, "invalid_ids", str(exc))
            self._owner_gone(req, owner, ReleaseReason.FAILED, str(exc))
            return False
        owner.plan, owner.src = plan, src
        self._to(owner, OwnerState.WRITING)
        return True

    def _pump(self, req: _Request, owner: _Owner) -> None:
        source = req.source
        assert source is not None
        for group in range(owner.groups):
            if owner.end is not None:
                break
            if group in owner.posted or not (source.complete or group in source.layers):
                continue
            self._post(req, owner, group)
        if len(owner.posted) == owner.groups:
            _cancel(owner.wait)  # nothing left to wait for from the engine
        self._conclude(req, owner)

    def _post(self, req: _Request, owner: _Owner, group: int) -> None:
        plan, peer, lay = owner.plan, owner.peer, self.layout
        n = len(plan.local_indices) // lay.num_regions   # descriptors per region
        if owner.groups == 1:
            lo, hi = 0, lay.num_regions
        else:
            per_layer = lay.num_regions // lay.num_layers
            lo, hi = group * per_layer, (group + 1) * per_layer
        part = owner.part * owner.groups + group
        owner.posted.add(group)
        if n == 0:  # nothing to move, but the consumer still counts this part
            self._send(peer, m.Posted(req.rid, owner.xid, part, empty=True))
            return
        assert req.source is not None and owner.src is not None
        req.source.stamps.setdefault("posted", self._now)
        sums = self.links.checksums(owner.src) if owner.verify and owner.groups == 1 else b""
        try:
            nbytes = (hi - lo) * n * self.links.desc_bytes(peer)
        except PeerUnavailable:
            nbytes = 0
        key = next(self._keys)
        who = (peer, owner.xid)
        rid = req.rid
        write = _Write(key, group, nbytes, plan.num_blocks,
                       self._after(self.config.transfer_timeout_s,
                                   lambda now: self._write_expired(rid, who, key)))
        owner.writes[group] = write
        self._writes[key] = (rid, who)
        # The hint goes out before the WRITE: the consumer starts polling for the Landed
        # notification while the bytes move, instead of waking after them.
        self._send(peer, m.Posted(rid, owner.xid, part,
                                  inline_s=self._inline.hint(peer, nbytes.bit_length())))
        self._out.append(Post(key, "WRITE", peer, plan.local_indices[lo * n:hi * n],
                              plan.remote_indices[lo * n:hi * n],
                              m.Landed(rid, owner.xid, part, sums, nbytes), nbytes,
                              plan.num_descriptors // lay.num_regions * (hi - lo),
                              getattr(plan, "runs", None), (lo, hi)))

    def _end_push(self, req: _Request, owner: _Owner, message: str, reason: ReleaseReason,
                  detail: str) -> None:
        """A push that will not complete: it ends once none of its WRITEs is in flight
        (they are left to finish: releasing a NIXL transfer in progress does not stop its
        bytes, so only their real end tells the consumer nothing more lands)."""
        if owner.end is None:
            owner.end = (message, reason, detail)
            _cancel(owner.wait)

    def _conclude(self, req: _Request, owner: _Owner) -> None:
        """End a writing owner once nothing of it is in flight."""
        if owner.state is not OwnerState.WRITING or owner.writes:
            return
        if owner.end is None:
            if len(owner.posted) < owner.groups:
                return  # layers still to come
            self._to(owner, OwnerState.DONE)
            owner.reason = ReleaseReason.TRANSFERRED
            req.done_owners.add((owner.peer, owner.xid))
            self.stats.requests_completed += 1
            return
        message, reason, detail = owner.end
        if reason is ReleaseReason.FAILED:
            self.stats.requests_failed += 1
        if owner.lost:
            # Its consumer was lost before its WRITEs ended: nothing it is told arrives,
            # and no Abort will acknowledge an abandoned WRITE, so there is nothing to
            # fence (an engine abort's Failed "sent" after the loss would fence the source
            # for max_wait_s, waiting for an Abort that cannot come). A consumer only cut
            # off may still see that WRITE land late, as for a FENCING owner lost
            # (peer_lost).
            req.unsafe |= owner.unfenced and owner.lost == "silent" and not owner.acked
        elif message == "ack":
            self._send(owner.peer, m.AbortAck(req.rid, owner.xid, owner.errored,
                                              owner.unfenced))
        elif message:
            failed = m.Failed(req.rid, owner.xid, message, detail, owner.errored,
                              owner.unfenced)
            self._send(owner.peer, failed)
            if owner.unfenced and not owner.acked:
                # The consumer has not given this use up: until it has read this Failed
                # (its Abort says so), a Landed of the abandoned WRITE could reach it first
                # and be trusted, so the WRITE must not read reused blocks.
                self._to(owner, OwnerState.FENCING)
                owner.reason, owner.detail = reason, detail
                who = (owner.peer, owner.xid)
                owner.wait = self._after(self.config.max_wait_s,
                                         lambda now: self._fence_expired(req.rid, who))
                self._resend_later(owner, failed)
                return
        self._owner_gone(req, owner, reason, detail)

    def _owner_gone(self, req: _Request, owner: _Owner, reason: ReleaseReason,
                    detail: str) -> None:
        _cancel(owner.wait)
        _cancel(owner.hold)
        _cancel(owner.resend)
        self._to(owner, OwnerState.GONE)
        owner.reason, owner.detail = reason, detail

    def _give_up(self, req: _Request, reason: ReleaseReason, detail: str, code: str) -> None:
        """The engine gave up a request that holds (or is getting) its source: every owner
        is told; the source is released once no transfer can read it."""
        for owner in req.live():
            if owner.state is OwnerState.WRITING:
                if owner.writes:  # tell the consumer now; Failed follows once they ended
                    self._send(owner.peer, m.Abort(req.rid, owner.xid, detail))
                self._end_push(req, owner, code, reason, detail)
                self._conclude(req, owner)
            elif owner.state is OwnerState.PULLING:
                owner.end = ("", reason, detail)
                owner.detail = detail
                self._fail(owner.peer, req.rid, owner.xid, code, detail)
            else:
                self._fail(owner.peer, req.rid, owner.xid, code, detail)
                self._owner_gone(req, owner, reason, detail)
        req.state, req.ending = State.ENDING, (reason, detail)

    def _settle(self, req: _Request) -> None:
        """Release the source once no transfer can read it and its owners are done with it
        (or, with owners still to come, its lease is over); forget a request once nothing
        of it is left. Called after every event that touches ``req``."""
        if self._requests.get(req.rid) is not req:
            return
        if req.state is State.WAITING:
            if not req.owners:
                del self._requests[req.rid]
            elif not req.live() and (req.tomb is None or req.tomb.cancelled):
                # Every owner gave up before prefill: remembered for tombstone_s, so a late
                # prefill_done is released at once (with the owners' reason), not after a
                # lease.
                self._tomb(req, "", "", state=State.WAITING)
            return
        source = req.source
        if req.state not in (State.PARTIAL, State.HELD, State.ENDING) or source is None:
            return
        live = req.live()
        if any(s.state in _READING for s in live):
            return  # a transfer may still read the blocks
        ended = [s for s in req.owners.values() if s.state not in _LIVE]
        all_came = req.sharers is not None and len(ended) >= req.sharers
        lease_over = source.lease is not None and self._now >= source.lease.deadline
        if req.state is State.ENDING:
            # An aborted pull source: a READ may still start under its ticket until the
            # lease ends, unless every owner has come and gone.
            if source.mode is TransferMode.PULL and not all_came and not lease_over:
                return
            assert req.ending is not None
            self._release(req, *req.ending)
            return
        if all_came:
            bad = next((s for s in ended if s.reason is not ReleaseReason.TRANSFERRED), None)
            if bad is None:
                self._release(req, ReleaseReason.TRANSFERRED)
            else:
                self._release(req, bad.reason, bad.detail)
            return
        if req.state is State.PARTIAL or live or not lease_over:
            return  # owners still to come (no lease runs before prefill_done)
        self.stats.requests_timed_out += 1
        if req.done_owners:
            self._release(req, ReleaseReason.TRANSFERRED,
                          f"{len(req.done_owners)} of {req.sharers} owners took it before "
                          f"the lease ended", code="lease_expired")
            return
        self._release(req, ReleaseReason.LEASE_EXPIRED, code="lease_expired",
                      why="source blocks were released after their lease")

    def _release(self, req: _Request, reason: ReleaseReason, detail: str = "", *,
                 code: str = "", why: str = "") -> None:
        source = req.source
        assert source is not None
        _cancel(source.lease)
        for owner in req.owners.values():
            _cancel(owner.wait)
            _cancel(owner.hold)
            _cancel(owner.resend)
            self._to(owner, OwnerState.GONE, Event.RELEASE)
        self.stats.blocks_released += len(source.ids)
        self.gauges["sources_held"] -= 1
        # Blocks a transfer may still read stay unchanged until it cannot any more: its
        # deadline, or -- a cut the consumer has not noticed yet can hold a WRITE and the
        # Bye behind it -- until the consumer gives this side up. A consumer judges silence
        # on its heartbeat ticks: it gives up at most peer_timeout_s after the first
        # heartbeat the cut leaves unanswered (asked up to heartbeat_s into the cut),
        # judged up to heartbeat_s later, and heartbeat_s <= peer_timeout_s / 2.
        hold = max(self.config.transfer_timeout_s, 2 * self.config.peer_timeout_s) \
            if req.unsafe else 0.0
        xids = tuple(sorted({xid for _, xid in req.owners} | {x for _, x in req.done_owners}))
        self._out.append(Emit(Release(req.rid, reason, source.ids, detail,
                                      {**source.stamps, "released": self._now}, source.sid,
                                      blocks_safe=not req.unsafe, quarantine_s=hold,
                                      mode=source.mode, xids=xids)))
        req.unsafe = False
        # A use whose prefill_done has not come (layer-wise, released early or aborted)
        # stays RELEASED_EARLY: its prefill_done, whenever the engine makes it, is this
        # use's and is swallowed -- never a new use whose blocks are held and released again.
        early = not source.complete
        req.released = (source.sid if source.named else 0, source.ids)
        req.ended_sid = req.released[0]
        queued, req.queued = req.queued, []
        if not code and reason is not ReleaseReason.TRANSFERRED:
            code = "aborted" if reason is ReleaseReason.ABORTED else "failed"
        why = why or detail
        req.source = None
        req.owners = {}
        req.ending = None
        self._tomb(req, code, why, state=State.RELEASED_EARLY if early else State.ENDED)
        if queued:
            # The registrations of the next use: they start it (whatever this use's end).
            self._reuse(req)
            for peer, msg, came in queued:
                if isinstance(msg, m.Register):
                    msg = msgspec.structs.replace(msg, wait_s=msg.wait_s - (self._now - came))
                self.on_message(self._now, peer, msg)

    def _tomb(self, req: _Request, code: str, why: str, state: State = State.ENDED) -> None:
        req.state, req.code, req.why = state, code, why
        req.extended = False
        _cancel(req.tomb)
        # Every ended use keeps a tombstone for tombstone_s (120 s): at a high request rate
        # a large population. Its timer holds the record and a method shared by all, not a
        # closure of its own (the garbage collector walks whatever they keep), in the
        # timers' FIFO lane (a constant delay: deadlines come in order; no heap work).
        self._arm_tomb(req, self._now)

    def _arm_tomb(self, req: _Request, now: float) -> None:
        req.tomb = self._timers.add(now + self.config.tombstone_s, self._expire_tomb_fn, req,
                                    fifo=True)

    def _expire_tomb(self, req: _Request, now: float) -> None:
        if self._requests.get(req.rid) is req:
            self._internal(req, Event.TOMB_OVER, now, settle=False)

    def _on_tomb_over(self, req: _Request, now: float) -> None:
        if req.state is State.RELEASED_EARLY and not req.extended and not req.aborted:
            # Its prefill_done is still to come (the engine neither made it nor aborted):
            # the record waits max_wait_s more for it.
            req.extended = True
            req.tomb = self._timers.add(now + self.config.max_wait_s, self._expire_tomb_fn,
                                        req)
            return
        if req.state in (State.ENDED, State.ABORTED_EARLY, State.RELEASED_EARLY) or (
                req.state is State.WAITING and not req.live()):
            del self._requests[req.rid]

    def _reuse(self, req: _Request) -> None:
        """A new use of an ended request id: its tombstone goes."""
        _cancel(req.tomb)
        req.extended = False
        req.state, req.code, req.why = State.WAITING, "", ""
        req.owners, req.sharers, req.done_owners = {}, None, set()
        req.aborted, req.released, req.abort_sid = False, None, 0

    # -- sending -----------------------------------------------------------------------------
    def _send(self, peer: str, msg: m.Message) -> None:
        self._out.append(Send(peer, msg))

    def _fail(self, peer: str, rid: str, xid: int, code: str, reason: str) -> None:
        """Tell ``peer`` its ``xid`` failed: final, the record refuses that xid from now
        on (:meth:`_failed_before`)."""
        self._send(peer, m.Failed(rid, xid, code, reason))
        req = self._requests.get(rid)
        if req is not None and (peer, xid) not in req.failed:
            if len(req.failed) >= MAX_FAILED_PER_REQUEST:
                del req.failed[next(iter(req.failed))]
            req.failed[(peer, xid)] = (code, reason)

    def _failed_before(self, req: _Request, peer: str, xid: int) -> bool:
        """Whether ``xid`` of ``peer`` was failed already (its Failed is sent again), or
        is a live owner's (a duplicate, dropped: failing it would tell its consumer that
        a use still served was over)."""
        failed = req.failed.get((peer, xid))
        owner = req.owners.get((peer, xid))
        if failed is None and (owner is None or owner.state not in _LIVE):
            return False
        self.stats.stale_messages += 1
        if failed is not None:
            self._send(peer, m.Failed(req.rid, xid, *failed))
        return True
