"""The simulated I/O driver: what ``Endpoint``/``Agent`` do for a real Producer or Consumer,
done against the fakes.

One :class:`Endpoint` is one incarnation of a producer or consumer process: its protocol
core, its fake memory and engine model, its loop (every event it handles goes through
:meth:`Endpoint.run`, which defers it while the loop is stalled), the handshake (Hellos
re-sent until answered), heartbeats and peer-liveness timeouts (the driver declares a
silent peer lost, as the real loop does), and the carrying out of the core's effects.
A restart is a new Endpoint under the same name.
"""

from __future__ import annotations

import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from .. import messages as m
from ..errors import ProtocolError
from ..layout import KVLayout
from ..protocol.effects import Abandon, DropPeer, Emit, Post, Send, XferEnd
from ..request import Release, TransferResult
from .engines import DecodeEngine, PrefillEngine
from .fakes import FakeMemory, SimLinks, Transfer

if TYPE_CHECKING:
    from .sim import Simulation

__all__ = ["Endpoint", "Peer"]

_IDEMPOTENT = (m.Hello, m.HelloAck, m.Heartbeat, m.HeartbeatAck)


@dataclass
class Peer:
    """This endpoint's view of one peer connection."""

    name: str
    up: bool = False
    inc: int = -1                # the peer incarnation the connection is with
    last_seen: float = 0.0
    hello_backoff: float = 0.0
    hello_armed: bool = False
    # consumer: (seq, when sent) of the oldest Heartbeat not answered yet (as the facade:
    # silence counts from a question asked, not across a stall of this side's loop)
    unanswered: tuple[int, float] | None = None


class Endpoint:
    """One incarnation of a producer (``role="producer"``) or consumer process."""

    def __init__(self, sim: Simulation, name: str, role: str, inc: int,
                 make_core: Callable[[Endpoint], Any], reopen: Endpoint | None = None) -> None:
        self.sim = sim
        self.name = name
        self.role = role
        self.inc = inc
        self.alive = True
        t = sim.timings
        self.engine: Any
        self.memory: FakeMemory
        if reopen is not None:   # closed and opened again over the same KV cache
            self.memory = reopen.memory
            self.engine = reopen.engine
            self.engine.ep = self
        else:
            first, heads, total = sim.heads_of(name)   # its tensor-parallel shard
            self.memory = FakeMemory(t.num_regions, t.num_blocks, heads, first, total)
            self.engine = PrefillEngine(sim, self) if role == "producer" \
                else DecodeEngine(sim, self)
        self.layout: KVLayout = self.memory.layout
        self.links = SimLinks(self.memory, sim.peer_memory)
        self.peers: dict[str, Peer] = {}
        self.lingering: set[str] = set()   # producer: peers lost, their DropPeer to come
        self.xfers: dict[int, Transfer] = {}      # posted here, end not yet reported
        self.closing = False
        self.clock_skew = 0.0        # this process's wall clock minus simulated time
        self.stalled_until = 0.0
        self.stall_total = 0.0
        self._stall_start = 0.0
        self.backlog: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._armed = math.inf
        self._same_deadline = 0
        self._hb_seq = 0
        self.core: Any = None
        self.core = make_core(self)

    @property
    def open(self) -> bool:
        """Whether the engine's calls reach this endpoint (alive and not closing)."""
        return self.alive and not self.closing

    # -- the loop ----------------------------------------------------------------------
    def run(self, fn: Callable[..., None], *args: Any) -> None:
        """Handle one event now, or later if the loop is stalled; then carry out effects
        and re-arm the core's timer."""
        if not self.alive:
            return
        if self.sim.sched.now < self.stalled_until:
            self.backlog.append((fn, args))
            return
        self._call(fn, *args)
        self.settle()

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a core that raises on an event is a bug in it
            self.sim.checker.fail(
                "core_raised", f"{self.name} ({self.role}) raised {exc!r} in "
                f"{getattr(fn, '__name__', fn)}{_short(args)}\n{traceback.format_exc()}")

    def settle(self) -> None:
        self.flush()
        if not self.alive:
            return
        n = self.core.in_flight()
        if n != len(self.xfers):   # the core lost (or invented) a transfer it must end
            self.sim.checker.fail("inflight_mismatch",
                                  f"{self.name}: core.in_flight()={n}, transfers posted and "
                                  f"not reported ended: {sorted(self.xfers)}")
        deadline = self.core.next_deadline()
        if deadline is not None and deadline < self._armed:
            self._armed = deadline
            self.sim.sched.at(deadline, self._timer, deadline)

    def flush(self) -> None:
        core = self.core
        for _ in range(10_000):
            effects = core.drain()
            if not effects:
                return
            for eff in effects:
                self._effect(eff)
        self.sim.checker.fail("effects_unbounded", f"{self.name}: drain never emptied")

    def _timer(self, deadline: float) -> None:
        if not self.alive or deadline != self._armed:
            return
        if self.sim.sched.now < self.stalled_until:
            return   # fires (late) on resume
        self._armed = math.inf
        self._call(self.core.tick, self.sim.sched.now)
        nxt = self.core.next_deadline()
        if nxt is not None and nxt <= deadline:
            self._same_deadline += 1
            if self._same_deadline > 1000:
                self.sim.checker.fail("deadline_stuck",
                                      f"{self.name}: next_deadline() stays at {nxt} after tick")
                self._same_deadline = 0
                self.flush()
                return
            self._armed = math.inf
            self.flush()
            self._armed = self.sim.sched.now + 1e-6
            self.sim.sched.at(self._armed, self._timer, self._armed)
            return
        self._same_deadline = 0
        self.settle()

    def stall(self, until: float) -> None:
        if until <= self.stalled_until or until <= self.sim.sched.now:
            return
        if self.sim.sched.now >= self.stalled_until:
            self._stall_start = self.sim.sched.now
        self.stalled_until = until
        self.sim.sched.at(until, self._resume, until)

    def _resume(self, until: float) -> None:
        if not self.alive or until != self.stalled_until:
            return
        self.stall_total += until - self._stall_start   # counted once the stall is over
        backlog, self.backlog = self.backlog, []
        if self.sim.sched.rng.random() < 0.5:
            # the loop may see its overdue timers (the core's, and the peer checks) before
            # what its sockets hold
            self._armed = math.inf
            self._call(self.core.tick, self.sim.sched.now)
            self.flush()
            timers = [e for e in backlog if e[0] == self._liveness]
            backlog = timers + [e for e in backlog if e[0] != self._liveness]
        for fn, args in backlog:
            self._call(fn, *args)
            self.flush()
        self._armed = math.inf       # timers that came due meanwhile fire now, late
        self.settle()

    def close(self, then: Callable[[], None]) -> None:
        """``Producer.close()`` / ``Consumer.close()``, as the loop carries it out (after
        what was queued before it): NIXL handles released (their bytes go on), the core
        closed (everything released CLOSED / ended ABORTED), Bye to every peer; then
        ``then()``. The engine keeps its KV cache and may open a new endpoint over it."""
        self.closing = True     # the engine's calls from now on raise ClosedError
        self.run(self._close, then)

    def _close(self, then: Callable[[], None]) -> None:
        if not self.alive:
            return
        now = self.sim.sched.now
        # ProducerCore.close() leaves the NIXL handles to the driver; ConsumerCore.close()
        # asks for them (Abandon effects). Whatever is left after the core is released.
        if self.role == "producer":
            self._release_handles()
        self._call(self.core.close, now)
        self.flush()
        self._release_handles()
        for peer in self.peers.values():
            if peer.up or self.role == "producer":
                self.send(peer.name, m.Bye(self.name))
        self.alive = False
        self.backlog.clear()
        then()

    def _release_handles(self) -> None:
        for key in list(self.xfers):
            xfer = self.xfers.pop(key)
            self.sim.nixl.abandon(xfer)
            xfer.reported = True

    def kill(self) -> None:
        self.alive = False
        self.backlog.clear()
        for xfer in list(self.sim.nixl.active.values()):
            if xfer.poster is self or xfer.target is self:
                self.sim.nixl.kill(xfer)
        self.engine.died()

    # -- control frames ----------------------------------------------------------------
    def send(self, peer: str, msg: m.Message) -> None:
        try:
            frame = m.encode(msg)
        except (msgspec.EncodeError, TypeError, ValueError) as exc:
            self.sim.checker.fail("bad_frame", f"{self.name} -> {peer}: cannot encode {msg!r}: "
                                  f"{exc}")
            return
        target = self.sim.endpoints.get(peer)
        if target is None:
            return
        if not isinstance(msg, _IDEMPOTENT):
            self.sim.checker.trace(f"{self.name} > {peer} {_brief(msg)}")
        if isinstance(msg, m.PullHeld) and self.role == "producer":
            src = self.engine.sources.get(msg.request_id)
            if src is not None:
                src.held_until[msg.xid] = self.sim.sched.now + msg.hold_s
        self.sim.net.send(self.name, peer, frame, target.receive, isinstance(msg, _IDEMPOTENT))

    def receive(self, sender: str, frame: bytes) -> None:
        self.run(self._on_frame, sender, frame)

    def _on_frame(self, sender: str, frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except ProtocolError as exc:
            self.sim.checker.fail("bad_frame", f"{sender} -> {self.name}: {exc}")
            return
        now = self.sim.sched.now
        if not isinstance(msg, _IDEMPOTENT):
            self.sim.checker.trace(f"{self.name} < {sender} {_brief(msg)}")
        if self.role == "producer":
            self._producer_frame(sender, msg, now)
        else:
            self._consumer_frame(sender, msg, now)

    def _producer_frame(self, sender: str, msg: m.Message, now: float) -> None:
        if isinstance(msg, m.Hello):
            inc = _inc(msg.agent_metadata)
            peer = self.peers.get(sender)
            if peer is not None and peer.up and peer.inc != inc:
                # a restarted consumer under the same name: the old one's WRITEs are given
                # up at once (as the facade does: its agent must be re-added)
                self._peer_lost(sender, "consumer reconnected", abandon=True)
                self.flush()
                peer = None
            if sender in self.lingering:
                # dropped already (silent), its WRITEs left to end: given up now, before
                # NIXL takes the new metadata (as the facade does)
                self._peer_lost(sender, "consumer reconnected", abandon=True)
                self.flush()
            if peer is None or not peer.up:
                peer = self.peers[sender] = Peer(sender, up=True, inc=inc, last_seen=now)
                self.core.peer_up(now, sender, KVLayout.from_wire(msg.layout))
                self.flush()
            peer.last_seen = now
            self.send(sender, m.HelloAck(self.name, _meta(self.name, self.inc),
                                         self.layout.to_wire()))
            return
        peer = self.peers.get(sender)
        if peer is None or not peer.up:
            # as the facade: tell a consumer we do not know what is true
            self.sim.stats["frames_from_unknown"] += 1
            if isinstance(msg, (m.Register, m.PullBegin, m.Claim)):
                self.send(sender, m.Failed(msg.request_id, msg.xid, "not_connected",
                                           "no handshake from this consumer"))
            elif isinstance(msg, m.Heartbeat):
                self.send(sender, m.Bye(self.name))
            return
        peer.last_seen = now
        if isinstance(msg, m.Heartbeat):
            self.send(sender, m.HeartbeatAck(msg.seq))
            if self.sim.timings.heartbeats_to_core:
                self.core.on_message(now, sender, msg)
        elif isinstance(msg, m.Bye):
            del self.peers[sender]
            self._peer_lost(sender, "bye")
        else:
            if isinstance(msg, (m.Register, m.Claim)):
                self.sim.producer_wait_started(msg.request_id)
            if isinstance(msg, m.Claim):     # it may hold the source up to max_wait_s
                src = self.engine.sources.get(msg.request_id)
                if src is not None:
                    src.claimed_at = now
            self.core.on_message(now, sender, msg)

    def _consumer_frame(self, sender: str, msg: m.Message, now: float) -> None:
        peer = self.peers.get(sender)
        if peer is None:
            return
        if isinstance(msg, m.HelloAck):
            inc = _inc(msg.agent_metadata)
            if peer.up and peer.inc == inc:
                peer.last_seen = now
                return            # a duplicate answer
            if peer.up:
                self._peer_lost(sender, "replaced by a new incarnation")
                self.flush()
            peer.up, peer.inc, peer.last_seen, peer.unanswered = True, inc, now, None
            self.core.peer_up(now, sender)     # the consumer core takes no layout
            return
        if not peer.up:
            self.sim.stats["frames_from_unknown"] += 1
            return
        peer.last_seen = now
        if isinstance(msg, m.HeartbeatAck):
            if peer.unanswered is not None and msg.seq >= peer.unanswered[0]:
                peer.unanswered = None
            return
        if isinstance(msg, m.Bye):
            self._lose(peer, "bye")
            return
        if isinstance(msg, m.HelloReject):
            self.sim.checker.fail("hello_rejected", f"{sender} refused {self.name}: {msg}")
            return
        self.core.on_message(now, sender, msg)

    # -- connections and liveness ------------------------------------------------------
    def connect(self, producer: str) -> None:
        """Consumer: keep Hello-ing ``producer`` until it answers (and again after it is
        lost), as the engine's connect() would."""
        peer = self.peers.setdefault(producer, Peer(producer))
        peer.hello_backoff = self.sim.timings.hello_retry_s
        self._arm_hello(peer)

    def _arm_hello(self, peer: Peer) -> None:
        if not peer.hello_armed:
            peer.hello_armed = True
            self.sim.sched.after(0.0, self.run, self._hello, peer)

    def _hello(self, peer: Peer) -> None:
        peer.hello_armed = False
        if peer.up or self.peers.get(peer.name) is not peer:
            return
        self.send(peer.name, m.Hello(self.name, _meta(self.name, self.inc),
                                     self.layout.to_wire()))
        peer.hello_armed = True
        self.sim.sched.after(peer.hello_backoff, self.run, self._hello, peer)
        peer.hello_backoff = min(peer.hello_backoff * 2, 0.5)

    def start_liveness(self) -> None:
        self.sim.sched.after(self.sim.sched.rng.uniform(0, self.sim.timings.heartbeat_s),
                             self.run, self._liveness)

    def _liveness(self) -> None:
        now = self.sim.sched.now
        t = self.sim.timings
        for peer in list(self.peers.values()):
            if not peer.up:
                continue
            if self.role == "producer":
                if now - peer.last_seen > t.peer_timeout_s:
                    self._lose(peer, f"silent for {now - peer.last_seen:.3f} s")
                continue
            asked = peer.unanswered
            if asked is not None and now - asked[1] > t.peer_timeout_s:
                self._lose(peer, f"no answer for {now - asked[1]:.3f} s")
                continue
            self._hb_seq += 1
            if asked is None:
                peer.unanswered = (self._hb_seq, now)
            self.send(peer.name, m.Heartbeat(self._hb_seq))
        self.sim.sched.after(t.heartbeat_s, self.run, self._liveness)

    def _lose(self, peer: Peer, why: str) -> None:
        peer.up = False
        self.sim.checker.trace(f"{self.name} lost {peer.name}: {why}")
        self._peer_lost(peer.name, why)
        self.flush()
        if self.role == "producer":
            self.peers.pop(peer.name, None)
        else:
            peer.hello_backoff = self.sim.timings.hello_retry_s
            self._arm_hello(peer)

    def _peer_lost(self, name: str, why: str, abandon: bool = False) -> None:
        now = self.sim.sched.now
        if self.role == "producer":
            self.lingering.add(name)     # until the core's DropPeer
        if abandon:
            self.core.peer_lost(now, name, why, abandon=True)
        else:
            self.core.peer_lost(now, name, why)

    # -- effects -----------------------------------------------------------------------
    def _effect(self, eff: Any) -> None:
        if isinstance(eff, Send):
            self.send(eff.peer, eff.msg)
        elif isinstance(eff, Post):
            self._post(eff)
        elif isinstance(eff, Abandon):
            self._abandon(eff)
        elif isinstance(eff, Emit):
            if isinstance(eff.item, Release) and self.role == "producer":
                self.engine.on_release(eff.item)
            elif isinstance(eff.item, TransferResult) and self.role == "consumer":
                self.engine.on_result(eff.item)
            else:
                self.sim.checker.fail("bad_effect", f"{self.name}: {eff!r}")
        elif isinstance(eff, DropPeer):
            peer = self.peers.get(eff.peer)
            self.lingering.discard(eff.peer)
            self.sim.checker.trace(f"{self.name} drop {eff.peer}: {eff.why}")
            if peer is not None:
                if self.role == "producer":
                    del self.peers[eff.peer]
                elif peer.up:
                    peer.up = False
                    peer.hello_backoff = self.sim.timings.hello_retry_s
                    self._arm_hello(peer)
        else:
            self.sim.checker.fail("bad_effect", f"{self.name}: unknown effect {eff!r}")

    def _post(self, eff: Post) -> None:
        sim = self.sim
        now = sim.sched.now
        if eff.key in self.xfers:
            sim.checker.fail("bad_effect", f"{self.name}: transfer key {eff.key} posted twice")
            return
        peer = self.peers.get(eff.peer)
        target = sim.endpoints.get(eff.peer)
        if peer is None or not peer.up or target is None or not target.alive \
                or target.inc != peer.inc:
            sim.checker.trace(f"{self.name} post {eff.key} to {eff.peer}: LOST")
            self.core.transfer_ended(now, eff.key, XferEnd.LOST)
            return
        local = eff.local.astype("int64", copy=False)
        remote = eff.remote.astype("int64", copy=False)
        rows = len(self.memory.data)
        if len(local) != len(remote) or (len(local) and (
                local.min() < 0 or local.max() >= rows
                or remote.min() < 0 or remote.max() >= len(target.memory.data))):
            sim.checker.fail("bad_effect", f"{self.name}: {eff.op} {eff.key} descriptor "
                             f"indices out of range or of unequal length")
            self.core.transfer_ended(now, eff.key, XferEnd.ERROR)
            return
        notif = m.encode(eff.notif)
        xid = int(getattr(eff.notif, "xid", 0))
        if eff.op == "WRITE":
            src, dst, src_rows, dst_rows = self.memory, target.memory, local, remote
            consumer = eff.peer
        elif eff.op == "READ":
            src, dst, src_rows, dst_rows = target.memory, self.memory, remote, local
            consumer = self.name
        else:
            sim.checker.fail("bad_effect", f"{self.name}: unknown op {eff.op!r}")
            return
        nb = src.num_blocks
        src_off, dst_off, length = src.overlap(dst)
        if length == 0:
            sim.checker.fail("bad_effect", f"{self.name}: {eff.op} {eff.key} to {eff.peer}, "
                             f"which holds none of the heads held here")
            self.core.transfer_ended(now, eff.key, XferEnd.ERROR)
            return
        xfer = Transfer(eff.key, eff.op, self, self.inc, target, target.inc, src, dst,
                        src_rows, dst_rows, notif, xid, consumer, now,
                        src_blocks=frozenset((src_rows % nb).tolist()), src_off=src_off,
                        dst_off=dst_off,
                        length=-1 if length == src.block_bytes == dst.block_bytes else length)
        self.xfers[eff.key] = xfer
        sim.checker.trace(f"{self.name} post {eff.op} {eff.key} -> {eff.peer} xid={xid:x} "
                          f"rows={len(local)}")
        if eff.op == "WRITE":
            self.engine.check_write(xfer)
        sim.start_transfer(xfer)
        if xfer.state == "landed":   # done inside the post: the driver says so at once
            self.transfer_finished(xfer, XferEnd.DONE)

    def _abandon(self, eff: Abandon) -> None:
        xfer = self.xfers.pop(eff.key, None)
        if xfer is None:
            self.sim.checker.fail("bad_effect", f"{self.name}: Abandon of transfer {eff.key}, "
                                  f"which is not in flight (never posted, or its end was "
                                  f"already reported)")
            return
        end = self.sim.nixl.abandon(xfer)
        xfer.reported = True
        self.sim.checker.trace(f"{self.name} abandon {eff.key}: {end.value}")
        if end is XferEnd.ABANDONED:
            self.sim.stats["abandoned_moving"] += 1
        self.core.transfer_ended(self.sim.sched.now, eff.key, end)

    def transfer_finished(self, xfer: Transfer, end: XferEnd) -> None:
        """The poster's poll sees the transfer's end (scheduled by the simulation)."""
        if xfer.reported or self.xfers.get(xfer.key) is not xfer:
            return
        xfer.reported = True
        del self.xfers[xfer.key]
        self.sim.checker.trace(f"{self.name} xfer {xfer.key} ended {end.value}")
        self.core.transfer_ended(self.sim.sched.now, xfer.key, end)

    def notification(self, sender: str, frame: bytes) -> None:
        msg = m.decode(frame)
        peer = self.peers.get(sender)
        if peer is None or not peer.up:
            self.sim.stats["notifs_from_unknown"] += 1
            return
        self.sim.checker.trace(f"{self.name} notif < {sender} {_brief(msg)}")
        self.core.on_notification(self.sim.sched.now, sender, msg)


def _meta(name: str, inc: int) -> bytes:
    return f"{name}#{inc}".encode()


def _inc(meta: bytes) -> int:
    try:
        return int(meta.rsplit(b"#", 1)[1])
    except (IndexError, ValueError):
        return -1


def _brief(msg: Any) -> str:
    name = type(msg).__name__
    rid = getattr(msg, "request_id", None)
    if rid is None:
        return name
    xid = getattr(msg, "xid", 0)
    extra = ""
    for f in ("code", "part", "sid", "errored", "unfenced", "hold_s"):
        v = getattr(msg, f, None)
        if v not in (None, 0, False, [], ""):
            extra += f" {f}={v:x}" if f == "sid" else f" {f}={v}"
    return f"{name}({rid} xid={xid:x}{extra})"


def _short(args: tuple[Any, ...]) -> str:
    # no addresses: the trace (and its hash) must be the same in every run of a seed
    text = re.sub(r" at 0x[0-9a-f]+", "", repr(args))
    return text if len(text) < 300 else text[:300] + "..."
