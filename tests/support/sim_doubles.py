"""TEST DOUBLES for the simulator's own tests -- not kvpush's consumer.

:class:`StandinConsumerCore` speaks protocol v2 from the consumer side (docs/PROTOCOL.md)
well enough to drive :mod:`kvpush.testing.sim` before (and independently of) the real
``kvpush.protocol.consumer.ConsumerCore``: push (Register, Posted, Landed, Failed, Abort,
AbortAck) and pull (PullBegin, READ, PullHeld, PullDone), deadlines and abort grace, lost
peers. It keeps no tombstones. :class:`EarlyReleaseProducer` wraps a real producer core to
plant the bug the checker must catch.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush import messages as m
from kvpush.errors import PeerUnavailable, RequestAborted, TransferFailed, TransferTimeout
from kvpush.protocol.effects import Abandon, Emit, Post, Send, XferEnd
from kvpush.request import Release, ReleaseReason, RequestState, TransferMode, TransferResult


@dataclass
class _Use:
    rid: str
    xid: int
    ids: np.ndarray
    peer: str
    mode: TransferMode
    started: float
    deadline: float
    sid: int = 0
    groups: int = 1
    posted_parts: set[int] = field(default_factory=set)
    landed_parts: set[int] = field(default_factory=set)
    held: bool = False
    hold_until: float = 0.0
    read_key: int = 0
    read_end: XferEnd | None = None
    ending: RequestState | None = None   # giving up with this state
    error: Any = None
    failed: bool = False                 # the producer said it will not deliver
    unsafe: bool = False
    grace: float = 0.0
    gen: int = 0

    @property
    def posted(self) -> bool:
        return bool(self.posted_parts)

    @property
    def landed(self) -> bool:
        """Nothing announced is still to land (every posted part landed or errored)."""
        return self.posted_parts <= self.landed_parts

    @property
    def complete(self) -> bool:
        return len(self.landed_parts) == self.groups


@dataclass
class _Cfg:
    abort_grace_s: float = 0.3


class StandinConsumerCore:
    """TEST DOUBLE (see the module docstring)."""

    def __init__(self, layout: Any, config: _Cfg, links: Any) -> None:
        self.layout = layout
        self.config = config
        self.links = links
        self._uses: dict[int, _Use] = {}
        self._by_rid: dict[str, int] = {}
        self._peers: set[str] = set()
        self._claims: dict[int, dict[str, int]] = {}
        self._keys = itertools.count(1)
        self._xfers: dict[int, int] = {}
        self._timers: list[tuple[float, int, int, int]] = []
        self._seq = itertools.count()
        self._out: list[Any] = []
        self.stats: dict[str, int] = {}

    # -- driver side
    def drain(self) -> list[Any]:
        out, self._out = self._out, []
        return out

    def next_deadline(self) -> float | None:
        while self._timers and self._stale(self._timers[0]):
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def _stale(self, t: tuple[float, int, int, int]) -> bool:
        use = self._uses.get(t[2])
        return use is None or use.gen != t[3]

    def tick(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, xid, gen = heapq.heappop(self._timers)
            use = self._uses.get(xid)
            if use is None or use.gen != gen:
                continue
            if use.ending is None:
                self._give_up(now, use, RequestState.TIMED_OUT,
                              TransferTimeout("request deadline passed"))
            else:
                use.unsafe = True
                if use.read_key in self._xfers:
                    self._out.append(Abandon(use.read_key))
                self._finish(now, use)

    def in_flight(self) -> int:
        return len(self._xfers)

    def status(self, rid: str) -> str:
        return "pending" if rid in self._by_rid else "none"

    def _arm(self, use: _Use, when: float) -> None:
        use.gen += 1
        heapq.heappush(self._timers, (when, next(self._seq), use.xid, use.gen))

    # -- engine events
    def expect(self, now: float, rid: str, ids: np.ndarray, producers: list[str],
               timeout: float, groups: int, tail: bool, sharers: list[int], xid: int) -> int:
        use = _Use(rid, xid, ids, producers[0], TransferMode.PUSH, now, now + timeout,
                   groups=groups)
        self._uses[xid] = use
        self._by_rid[rid] = xid
        if use.peer not in self._peers:
            use.failed = True
            self._finish(now, use, RequestState.FAILED, PeerUnavailable("not connected"))
            return xid
        self._out.append(Send(use.peer, m.Register(rid, xid, m.encode_ids(ids), 0, timeout,
                                                   groups=groups, sharers=sharers[0])))
        self._arm(use, use.deadline)
        return xid

    def pull(self, now: float, tickets: list[m.PullTicket], sources: list[np.ndarray],
             dst: np.ndarray, budget: float, sharers: int, xid: int) -> int:
        t = tickets[0]
        self._claims.pop(xid, None)
        use = _Use(t.request_id, xid, dst, t.producer, TransferMode.PULL, now, now + budget,
                   sid=t.sid)
        self._uses[xid] = use
        self._by_rid[use.rid] = xid
        if use.peer not in self._peers:
            self._finish(now, use, RequestState.FAILED, PeerUnavailable("not connected"))
            return xid
        if budget <= 0:
            self._finish(now, use, RequestState.TIMED_OUT, TransferTimeout("lease over"))
            return xid
        self._out.append(Send(use.peer, m.PullBegin(use.rid, xid, t.sid, sharers)))
        plan = self.links.plan(use.peer, dst, sources[0], True)
        key = next(self._keys)
        use.read_key = key
        self._xfers[key] = xid
        self._out.append(Post(key, "READ", use.peer, plan.local_indices, plan.remote_indices,
                              m.PullDone(use.rid, xid, t.sid), 0, plan.num_descriptors))
        self._arm(use, use.deadline)
        return xid

    def claim(self, now: float, tickets: list[m.PullTicket], sharers: int, xid: int) -> int:
        ticket = tickets[0]
        if ticket.producer in self._peers:
            self._out.append(Send(ticket.producer, m.Claim(ticket.request_id, xid, ticket.sid,
                                                           sharers)))
        self._claims[xid] = {ticket.producer: ticket.sid}
        return xid

    def abort_claim(self, now: float, rid: str, xid: int, reason: str) -> None:
        for name in self._claims.pop(xid, {}):
            if name in self._peers:
                self._out.append(Send(name, m.Abort(rid, xid, reason)))

    def close(self, now: float) -> None:
        for use in list(self._uses.values()):
            if use.read_key in self._xfers:
                self._out.append(Abandon(use.read_key))
            use.unsafe |= not use.complete if use.mode is TransferMode.PUSH \
                else use.read_key in self._xfers
            self._finish(now, use, RequestState.ABORTED, RequestAborted("closed"))
        self._xfers.clear()

    def abort(self, now: float, rid: str, state: RequestState, error: Any) -> None:
        xid = self._by_rid.get(rid)
        if xid is None:
            return
        use = self._uses[xid]
        if use.ending is None:
            self._give_up(now, use, state, error)

    # -- network events
    def peer_up(self, now: float, peer: str) -> None:
        self._peers.add(peer)

    def peer_lost(self, now: float, peer: str, why: str) -> None:
        self._peers.discard(peer)
        for use in list(self._uses.values()):
            if use.peer != peer:
                continue
            if use.mode is TransferMode.PUSH:
                # a Register in flight (or held by a stalled producer) may still be
                # served: nothing is safe until the producer said how it ended
                use.unsafe |= not use.complete
            elif use.read_key in self._xfers:
                self._out.append(Abandon(use.read_key))
                use.unsafe = True
            use.failed = True
            self._finish(now, use, RequestState.FAILED, PeerUnavailable(why))

    def on_message(self, now: float, peer: str, msg: Any) -> None:
        if isinstance(msg, m.Failed) and msg.unfenced:
            # docs/PROTOCOL.md: the producer fences the source of an abandoned WRITE until
            # this side's Abort for the xid acknowledges it (a stale one too).
            self._out.append(Send(peer, m.Abort(msg.request_id, msg.xid,
                                                "unfenced write acknowledged")))
        use = self._uses.get(getattr(msg, "xid", 0))
        if use is None or use.peer != peer:
            return
        if isinstance(msg, m.Posted):
            use.posted_parts.add(msg.part)
            if msg.empty:
                use.landed_parts.add(msg.part)
        elif isinstance(msg, (m.Failed, m.AbortAck)):
            use.failed = True
            use.unsafe |= msg.unfenced
            use.landed_parts.update(msg.errored)   # nothing more lands from them
            state = use.ending or RequestState.FAILED
            self._finish_when_quiet(now, use, state, use.error or TransferFailed(
                getattr(msg, "reason", "aborted")))
        elif isinstance(msg, m.Abort):
            use.failed = True
            self._finish_when_quiet(now, use, RequestState.ABORTED, RequestAborted(msg.reason))
        elif isinstance(msg, m.PullHeld):
            use.held = True
            use.hold_until = use.started + msg.hold_s
            self._try_ready(now, use)

    def on_notification(self, now: float, peer: str, msg: Any) -> None:
        if isinstance(msg, m.Landed):
            use = self._uses.get(msg.xid)
            if use is None or use.peer != peer:
                return
            use.landed_parts.add(msg.part)
            use.posted_parts.add(msg.part)
            if use.failed:     # the producer's word came: finish once nothing is to land
                self._finish_when_quiet(now, use, use.ending or RequestState.FAILED,
                                        use.error or TransferFailed("failed"))
            elif use.ending is not None:
                pass           # aborting: wait for the AbortAck (it names what is in flight)
            elif use.complete:
                self._finish(now, use, RequestState.READY, None)

    def transfer_ended(self, now: float, key: int, end: XferEnd) -> None:
        xid = self._xfers.pop(key, None)
        use = self._uses.get(xid) if xid is not None else None
        if use is None:
            return
        use.read_end = end
        if end is XferEnd.ABANDONED:
            use.unsafe = True
        if end is not XferEnd.DONE:
            self._out.append(Send(use.peer, m.PullDone(use.rid, use.xid, use.sid)))
            use.failed = True
        if use.failed or use.ending is not None:
            self._finish(now, use, use.ending or RequestState.FAILED,
                         use.error or TransferFailed("READ failed"))
        else:
            self._try_ready(now, use)

    # -- helpers
    def _try_ready(self, now: float, use: _Use) -> None:
        if use.held and use.read_end is XferEnd.DONE and use.ending is None:
            if now <= use.hold_until:
                self._finish(now, use, RequestState.READY, None)
            else:
                self._finish(now, use, RequestState.FAILED, TransferFailed("READ too slow"))

    def _give_up(self, now: float, use: _Use, state: RequestState, error: Any) -> None:
        use.ending, use.error = state, error
        self._out.append(Send(use.peer, m.Abort(use.rid, use.xid, str(error))))
        self._arm(use, now + self.config.abort_grace_s)
        if use.mode is TransferMode.PULL and use.read_key not in self._xfers:
            self._finish(now, use, state, error)
        # else wait for the READ's end, the AbortAck (push), or the grace

    def _finish_when_quiet(self, now: float, use: _Use, state: RequestState,
                           error: Any) -> None:
        if use.mode is TransferMode.PUSH and use.posted and not use.landed and not use.unsafe:
            use.ending = use.ending or state
            use.error = use.error or error
            return   # its Landed comes behind its bytes
        if use.mode is TransferMode.PULL and use.read_key in self._xfers:
            use.ending = use.ending or state
            use.error = use.error or error
            return
        self._finish(now, use, state, error)

    def _finish(self, now: float, use: _Use, state: RequestState | None = None,
                error: Any = None) -> None:
        if self._uses.pop(use.xid, None) is None:
            return
        if self._by_rid.get(use.rid) == use.xid:
            del self._by_rid[use.rid]
        state = state or use.ending or RequestState.FAILED
        self._out.append(Emit(TransferResult(use.rid, state, use.mode, error or use.error,
                                            now - use.started, 0, not use.unsafe,
                                            xid=use.xid, block_ids=use.ids)))


def standin_consumer(ep: Any) -> StandinConsumerCore:
    return StandinConsumerCore(ep.layout, _Cfg(ep.sim.timings.abort_grace_s), ep.links)


class EarlyReleaseProducer:
    """A PLANTED BUG: a producer core that releases a push source as soon as it posts the
    WRITE reading it (before the WRITE has ended) -- and swallows the real release later."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._early: set[str] = set()
        self._held: dict[str, np.ndarray] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prefill_done(self, now: float, rid: str, ids: np.ndarray, mode: Any, sid: int) -> None:
        self._held[rid] = ids
        self._inner.prefill_done(now, rid, ids, mode, sid)

    def drain(self) -> list[Any]:
        out = []
        for eff in self._inner.drain():
            if isinstance(eff, Emit) and isinstance(eff.item, Release) \
                    and eff.item.request_id in self._early:
                self._early.discard(eff.item.request_id)
                continue
            out.append(eff)
            if isinstance(eff, Post) and eff.op == "WRITE":
                rid = eff.notif.request_id  # type: ignore[union-attr]
                ids = self._held.pop(rid, None)
                if ids is not None and rid not in self._early:
                    self._early.add(rid)
                    out.append(Emit(Release(rid, ReleaseReason.TRANSFERRED, ids, "early")))
        return out
