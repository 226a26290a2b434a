"""One simulated process: the production driver, sessions and core of a Producer or a
Consumer, run without their thread on the simulation's clock.

One :class:`Endpoint` is one incarnation of a producer or consumer process. Its loop is a
real :class:`kvpush.driver.Driver` made with a :class:`~kvpush.driver.LoopIO`: the
simulation's clock (and this process's skewed wall clock), nonces from the seed, ZeroMQ's
sockets from :mod:`kvpush.testing.wire` over the simulated network, and :class:`SimAgent`,
a NIXL agent over the fake memory and the fake NIXL. Its sessions are the real
:class:`kvpush.sessions.Accepting` or :class:`kvpush.sessions.Dialing`, and its core the
role's real core (or a planted one). The simulation runs one loop iteration
(:meth:`kvpush.driver.Driver.step`) whenever something may have happened to the process --
a frame landed in one of its sockets, an engine call was queued, a transfer it posted
ended, a notification came, its next timer came due -- and none while the process is
stalled: frames then wait in its sockets and its timers come due late, as in a stopped
process.

What the simulation checks here it checks by watching, never by doing the loop's work: the
frames on the wire, the effects of each session machine, what the core is told, and after
each iteration that the core and the driver agree on the transfers in flight. A restart is
a new Endpoint under the same name.
"""

from __future__ import annotations

import itertools
import math
import re
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from .. import messages as m
from ..agent import TransportConfig, XferState
from ..dataplane import DataPlaneLost
from ..driver import Driver, LoopIO
from ..errors import ClosedError, PeerUnavailable
from ..layout import KVLayout
from ..progress import ProgressPolicy
from ..protocol.effects import ClaimGone, XferEnd
from ..protocol.session import (
    Admit,
    ConnectFailed,
    DialState,
    Link,
    PeerDown,
    PeerUp,
    SessionEffect,
    Transmit,
)
from ..request import Release, TransferResult
from ..sessions import Accepting, Dialing
from . import wire
from .engines import DecodeEngine, PrefillEngine
from .fakes import FakeMemory, SimLinks, Transfer

if TYPE_CHECKING:
    from .sim import Simulation

__all__ = ["Endpoint", "SimAgent", "SimNetwork", "peek", "spellings"]

_IDEMPOTENT = (m.Probe, m.Challenge, m.Hello, m.HelloAck, m.Heartbeat, m.HeartbeatAck)
_PORT = 5555
#: loop iterations at one instant after which an endpoint is taken for stuck (a deadline
#: that stays due after its tick)
_SAME_INSTANT = 1000
_decoder = msgspec.msgpack.Decoder(m.Message)
_SEAL = 2 + 8 + 32   # version, flag, counter, tag


def peek(frame: bytes | memoryview) -> m.Message | None:
    """The message a control frame or a notification carries, seal unchecked: the
    simulation reads the wire as an observer (the sessions check seals)."""
    data = bytes(frame)
    if len(data) < 3:
        return None
    try:
        msg: m.Message = _decoder.decode(data[2:] if data[1] == 0 else data[_SEAL:])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return msg


#: How long a frame may stay in a driver's outbox after its peer has room again (the
#: driver's retries back off to 50 ms).
OUTBOX_RETRY_S = 0.2
#: Every simulated socket's high-water mark. ZeroMQ's here is ``driver.SEND_HWM`` (16,384
#: frames); the simulation's streams are short, so a small one is what lets a stalled
#: process's peers meet it: their frames wait in the driver's outbox and go in order.
SIM_HWM = 8


class SimNetwork(wire.Network):
    """:mod:`kvpush.testing.wire` over the simulation's network (delays, cuts, resets, and
    duplicates of the frames a peer may see twice); every frame delivered is one an
    attacker could have captured (fault ``forge``)."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__()
        self.sim = sim
        self.hwm = SIM_HWM
        for i, producer in enumerate(sim.producer_names):   # its spellings reach its host
            for address in spellings(producer, i):
                self.hosts[_host(address)] = producer

    def carry(self, src: wire.Socket, dst: wire.Socket, frames: list[bytes],
              arrive: Callable[[], None]) -> None:
        assert isinstance(src.ctx, SimContext) and isinstance(dst.ctx, SimContext)
        sender, receiver = src.ctx.endpoint, dst.ctx.endpoint
        frame = frames[-1]
        msg = peek(frame)
        idempotent = isinstance(msg, _IDEMPOTENT)
        if not idempotent:
            self.sim.checker.trace(f"{sender.name} > {receiver.name} {_brief(msg)}")
        # the consumer side of a frame is named by its connection (c1/3.7)
        who = frames[0].decode() if src.kind == zmq.DEALER else sender.name
        hello = isinstance(msg, m.Hello)

        def deliver(_: str, __: bytes) -> None:
            self.sim.sent_frame(who, receiver.name, frame, hello)
            arrive()
        self.sim.net.send(sender.name, receiver.name, frame, deliver, idempotent)


class SimContext(wire.Context):
    """The sockets of one incarnation, on its host (a producer's: its name)."""

    def __init__(self, ep: Endpoint, host: str) -> None:
        super().__init__(ep.sim.wire, host, on_frame=ep.wake, identify=ep.identify)
        self.endpoint = ep


class SimAgent:
    """The NIXL agent of one incarnation: its fake memory, the peers it loaded (by the
    incarnation their metadata names), transfers on the fake NIXL, notifications queued
    for the loop. A post to a peer it does not know, or whose process is gone or is another
    incarnation than the one loaded, raises PeerUnavailable (NIXL has no connection to it)."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        # agent name -> (incarnation, data-plane generation) of the metadata loaded
        self.peers: dict[str, tuple[int, int]] = {}
        self.generation = 0   # data-plane children started before this one
        self.lost: str | None = None   # why the data-plane child died, until restarted
        self.inbox: dict[str, list[bytes]] = {}  # notifications not read yet, by sender
        self.last_explicit = 0
        self._keys = itertools.count()

    @property
    def layout(self) -> KVLayout:
        return self.ep.memory.layout

    def metadata(self) -> bytes:
        return _meta(self.ep.name, self.ep.inc, self.generation)

    def add_peer(self, metadata: bytes, layout: KVLayout, name: str) -> str:
        agent = metadata.split(b"#", 1)[0].decode(errors="replace")
        self.peers[agent] = (_inc(metadata), _generation(metadata))
        return agent

    @property
    def pid(self) -> int:
        return self.generation

    def restart(self) -> None:
        """A new data-plane child: new NIXL metadata, no peer loaded, no notification
        left (the driver makes the handshakes again)."""
        self.lost = None
        self.generation += 1
        self.peers.clear()
        self.inbox.clear()

    def remove_peer(self, name: str) -> None:
        self.peers.pop(name, None)

    def post(self, op: str, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes,
             runs: Any = None, regions: Any = None) -> Transfer:
        ep, sim = self.ep, self.ep.sim
        if self.lost is not None:   # as a ChildAgent whose child died answers
            raise DataPlaneLost(f"data plane lost: {self.lost}")
        target = sim.endpoints.get(peer)
        if peer not in self.peers or target is None or not target.alive \
                or self.peers[peer] != (target.inc, target.agent.generation):
            sim.checker.trace(f"{ep.name} post to {peer}: not connected")
            raise PeerUnavailable(f"NIXL has no connection to {peer}")
        local = np.asarray(local).astype("int64", copy=False)
        remote = np.asarray(remote).astype("int64", copy=False)
        rows = len(ep.memory.data)
        if len(local) != len(remote) or (len(local) and (
                local.min() < 0 or local.max() >= rows
                or remote.min() < 0 or remote.max() >= len(target.memory.data))):
            sim.checker.fail("bad_effect", f"{ep.name}: {op} to {peer}: descriptor indices "
                             f"out of range or of unequal length")
            raise PeerUnavailable("bad descriptors")
        if op == "WRITE":
            src, dst, src_rows, dst_rows, consumer = ep.memory, target.memory, local, remote, \
                peer
        elif op == "READ":
            src, dst, src_rows, dst_rows, consumer = target.memory, ep.memory, remote, local, \
                ep.name
        else:
            sim.checker.fail("bad_effect", f"{ep.name}: unknown op {op!r}")
            raise PeerUnavailable(f"unknown op {op!r}")
        src_off, dst_off, length = src.overlap(dst)
        if length == 0:
            sim.checker.fail("bad_effect", f"{ep.name}: {op} to {peer}, which holds none of "
                             f"the heads held here")
            raise PeerUnavailable("no heads in common")
        msg = peek(notif)
        xid = int(getattr(msg, "xid", 0))
        nb = src.num_blocks
        xfer = Transfer(next(self._keys), op, ep, ep.inc, target, target.inc, src, dst,
                        src_rows, dst_rows, notif, xid, consumer, sim.sched.now,
                        src_blocks=frozenset((src_rows % nb).tolist()), src_off=src_off,
                        dst_off=dst_off,
                        length=-1 if length == src.block_bytes == dst.block_bytes else length)
        sim.checker.trace(f"{ep.name} post {op} -> {peer} xid={xid:x} rows={len(local)}")
        if op == "WRITE":
            ep.engine.check_write(xfer)
        sim.start_transfer(xfer)
        return xfer

    def state(self, xfer: Transfer) -> XferState:
        if xfer.state == "moving" or self.lost is not None:
            return XferState.IN_PROGRESS
        return XferState.DONE if xfer.state == "landed" else XferState.ERROR

    def release(self, xfer: Transfer) -> bool:
        """NIXL lets go of the handle; a transfer still moving goes on moving (a dead
        child's moved no more)."""
        if not xfer.reported:
            end = self.ep.sim.nixl.abandon(xfer)
            xfer.reported = True
            if end is XferEnd.ABANDONED:
                self.ep.sim.stats["abandoned_moving"] += 1
            self.ep.sim.checker.trace(f"{self.ep.name} released {xfer.op} {xfer.key}: "
                                      f"{end.value}")
        return True

    def notify(self, sender: str, notif: bytes) -> None:
        self.inbox.setdefault(sender, []).append(notif)

    def notifications(self) -> dict[str, list[bytes]]:
        if self.lost is not None:
            return {}
        out, self.inbox = self.inbox, {}
        return out

    def close(self) -> None:
        """Nothing to let go of: the fake memory stays with the engine (an endpoint opened
        again over the same cache uses it), and the driver released every transfer."""


class Endpoint:
    """One incarnation of a producer (``role="producer"``) or consumer process."""

    def __init__(self, sim: Simulation, name: str, role: str, inc: int,
                 make_core: Callable[[Endpoint], Any], reopen: Endpoint | None = None) -> None:
        self.sim = sim
        self.name = name
        self.role = role
        self.inc = inc
        self.alive = True
        self.closing = False
        t = sim.timings
        self.engine: Any
        self.memory: FakeMemory
        if reopen is not None:   # closed and opened again over the same KV cache
            self.memory = reopen.memory
            self.engine = reopen.engine
            self.engine.ep = self
            if role == "producer":   # claims for a next use went with the closed core
                self.engine.pending_claims.clear()
        else:
            first, heads, total = sim.heads_of(name)   # its tensor-parallel shard
            self.memory = FakeMemory(t.num_regions * (2 if t.kv_apart else 1), t.num_blocks,
                                     heads, first, total, kv_apart=t.kv_apart)
            self.engine = PrefillEngine(sim, self) if role == "producer" \
                else DecodeEngine(sim, self)
        self.layout: KVLayout = self.memory.layout
        self.links = SimLinks(self.memory, sim.peer_memory)   # what the core plans with
        self.clock_skew = 0.0        # this process's wall clock minus simulated time
        self.dialing: set[str] = set()   # consumer: addresses its engine keeps connected
        # consumer: the engine's connect() calls not answered yet: (producer, when called)
        self.waiters: dict[int, tuple[str, str, float]] = {}
        self._calls = itertools.count()
        self.stalled_until = 0.0
        self.stall_total = 0.0       # stalls over (see stalled_s)
        self._stall_start = 0.0
        self._stall_counted = True   # the last stall is in stall_total
        self._armed = math.inf       # when the next loop iteration is scheduled
        self._instant = (-1.0, 0)    # (a time, iterations run at it)
        # outbox key -> since when its peer has had room (see _check_outbox)
        self._outbox_room: dict[tuple[Any, bytes | None], float] = {}
        # an attacker's frames not handled yet, by id (the frame itself is kept: an id
        # is only unique while its object lives)
        self._attack: dict[int, bytes] = {}
        self._attacked = False       # the frame being handled is an attacker's
        self._losing_plane = False   # its data plane's loss is being carried out
        self.agent = SimAgent(self)
        self._conns = itertools.count(1)
        self.ctx = SimContext(self, name if role == "producer" else f"{name}.host")
        io = LoopIO(clock=lambda: sim.sched.now,
                    wall=lambda: sim.sched.now + self.clock_skew, nonce=sim.nonce,
                    context=self.ctx, agent=lambda _name, _layout: self.agent)
        self.driver = Driver(self.layout, role=role, name=name, transport=TransportConfig(),
                             progress=ProgressPolicy(), auth_key=sim.auth_key, io=io)
        self.core: Any = make_core(self)
        self.sessions: Any
        if role == "producer":
            # bound to every interface and dialled by a host name, so only the challenge
            # tells a Hello meant for this producer from one meant for another
            self.sessions = Accepting(self.driver, self.core, host="0.0.0.0", port=_PORT,
                                      advertise=name, peer_timeout_s=t.peer_timeout_s)
        else:
            self.sessions = Dialing(self.driver, self.core, peer_timeout_s=t.peer_timeout_s,
                                    heartbeat_s=t.heartbeat_s,
                                    connect_timeout_s=t.connect_timeout_s)
        self._watch()
        self.driver.start(self.core, self.sessions, self._deliver, lambda: None)
        self.wake()
        if role == "producer":
            self._watch_liveness()

    @property
    def open(self) -> bool:
        """Whether the engine's calls reach this endpoint (alive and not closing)."""
        return self.alive and not self.closing

    @property
    def dialers(self) -> Any:
        """Consumer: its session machines (:class:`kvpush.protocol.session.Dialers`)."""
        return self.sessions.machine

    # -- the loop ----------------------------------------------------------------------
    def run(self, fn: Callable[..., None], *args: Any) -> None:
        """An engine's call: queued for the loop (as the facades' calls are), carried out
        by its next iteration with what it asks of the core."""
        if not self.alive:
            return

        def command() -> None:
            self._call(fn, *args)
            self.driver.apply()
        try:
            self.driver.call_soon(command)
        except ClosedError:
            return
        self.wake()

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a core that raises on an event is a bug in it
            self.sim.checker.fail(
                "core_raised", f"{self.name} ({self.role}) raised {exc!r} in "
                f"{getattr(fn, '__name__', fn)}{_short(args)}\n{traceback.format_exc()}")

    def wake(self, delay: float = 0.0) -> None:
        """Run a loop iteration ``delay`` from now (or when a stall ends)."""
        if not self.alive:
            return
        when = max(self.sim.sched.now + delay, self.stalled_until)
        if when < self._armed:
            self._armed = when
            self.sim.sched.at(when, self._step, when)

    def _step(self, when: float) -> None:
        if not self.alive or when != self._armed:
            return
        self._armed = math.inf
        now = self.sim.sched.now
        if now < self.stalled_until:
            self.wake()
            return
        at, count = self._instant
        self._instant = (now, count + 1 if at == now else 1)
        if self._instant[1] > _SAME_INSTANT:
            self.sim.checker.fail("deadline_stuck", f"{self.name}: {_SAME_INSTANT} loop "
                                  f"iterations at t={now:.6f} (next wake "
                                  f"{self.driver.next_wake()})")
            self._instant = (now, 0)
            return
        if self.agent.lost is not None:
            self._call(self._plane_lost)
        self._call(self.driver.step)
        if not self.alive:
            return
        n = self.core.in_flight()
        posted = self.driver.in_flight
        if n != posted:   # the core lost (or invented) a transfer it must end
            self.sim.checker.fail("inflight_mismatch", f"{self.name}: core.in_flight()={n}, "
                                  f"transfers posted and not reported ended: {posted}")
        self._check_outbox(now)
        due = self.driver.next_wake()
        if due is not None:
            self.wake(max(0.0, due - now))

    def _check_outbox(self, now: float) -> None:
        """A control frame ZeroMQ refused waits in the driver's outbox only while its peer
        cannot take it: once the peer has had room for :data:`OUTBOX_RETRY_S` (the
        driver retries every 50 ms at most), the frame must have gone."""
        room = self._outbox_room
        for key in list(room):
            if key not in self.driver._outbox:
                del room[key]
        for key in self.driver._outbox:
            sock, identity = key
            assert isinstance(sock, wire.Socket)
            if not sock.would_take(identity):
                room.pop(key, None)
            elif now - room.setdefault(key, now) > OUTBOX_RETRY_S:
                self.sim.checker.fail("outbox_stuck", f"{self.name}: frames for "
                                      f"{identity or sock.address!r} still queued "
                                      f"{now - room[key]:.3f} s after the peer had room")
                room[key] = now

    def stall(self, until: float) -> None:
        if until <= self.stalled_until or until <= self.sim.sched.now:
            return
        if self.sim.sched.now >= self.stalled_until:
            self._stall_start = self.sim.sched.now
            self._stall_counted = False
        self.stalled_until = until
        self.sim.sched.at(until, self._resume, until)

    def stalled_s(self) -> float:
        """Seconds this loop has been stalled so far, a stall going on counted up to now
        (the checker's bounds move by it as it elapses, and by what is left of it)."""
        if self._stall_counted:
            return self.stall_total
        return self.stall_total + min(self.sim.sched.now, self.stalled_until) - self._stall_start

    def _resume(self, until: float) -> None:
        if not self.alive or until != self.stalled_until:
            return
        self.stall_total += until - self._stall_start   # counted once the stall is over
        self._stall_counted = True
        self._armed = math.inf
        self.wake()

    def close(self, then: Callable[[], None]) -> None:
        """``Producer.close()`` / ``Consumer.close()`` after what was queued before it: the
        driver's own close (Bye to every peer, the core closed, NIXL handles released);
        then ``then()``. The engine keeps its KV cache and may open a new endpoint over it."""
        self.closing = True     # the engine's calls from now on raise ClosedError
        self.run(lambda: self.sim.sched.after(0.0, self._close, then))

    def _close(self, then: Callable[[], None]) -> None:
        if not self.alive:
            return
        self._call(self.driver.close)
        self.alive = False
        then()

    def kill(self) -> None:
        self.alive = False
        self._stop_transfers()
        self.driver.abandon()
        self.engine.died()

    def _deliver(self, item: Any) -> None:
        if isinstance(item, Release) and self.role == "producer":
            self.engine.on_release(item)
        elif isinstance(item, TransferResult) and self.role == "consumer":
            self.engine.on_result(item)
        elif isinstance(item, ClaimGone) and self.role == "consumer":
            self.sim.checker.trace(f"{self.name} claim gone {item.request_id} "
                                   f"xid={item.xid:x}")
            # Its producers hold nothing for it past the bounds of being told (an Abort,
            # or this consumer's loss): no more max_wait_s (see Simulation._check_released).
            for ep in self.sim.endpoints.values():
                if ep.role == "producer":
                    ep.engine.claim_gone(self.sim.sched.now, self.name, item.request_id,
                                         item.xid)
        else:
            self.sim.checker.fail("bad_effect", f"{self.name}: delivered {item!r}")

    # -- what reaches the process from outside -----------------------------------------
    def notification(self, sender: str, frame: bytes) -> None:
        """A NIXL notification from ``sender`` lands here (the loop reads it when the core
        waits for one)."""
        if self.alive:
            self.agent.notify(sender, frame)
            self.wake()

    def lose_data_plane(self) -> None:
        """The data-plane child dies now: its transfers stop where they are and its agent
        answers as a dead child's does; the loop learns it at its next iteration, before
        anything else (a real one from the child's channel), and restarts it."""
        if not self.open:
            return
        self._stop_transfers()
        self.agent.lost = "the child was killed (simulated)"
        self.wake()

    def _stop_transfers(self) -> None:
        """Every transfer this process posts or is the target of stops where it is."""
        for xfer in list(self.sim.nixl.active.values()):
            if xfer.poster is self or xfer.target is self:
                self.sim.nixl.kill(xfer)

    def _plane_lost(self) -> None:
        self._losing_plane = True   # handshakes it ends were not refused
        try:
            self.driver._data_plane_lost("the child was killed (simulated)")
        finally:
            self._losing_plane = False

    def transfer_moved(self) -> None:
        """A transfer this process posted ended: its next poll sees it."""
        self.wake()

    def attacked(self, sender: str, frame: bytes) -> None:
        """A frame from an attacker, under ``sender``: into the producer's socket as the
        connection of that identity (its own, or the genuine one it splices into), or into
        the consumer's connection to producer ``sender``. With a key, it may earn a refusal
        and nothing else."""
        if not self.alive:
            return
        frame = bytes(bytearray(frame))   # its own object: a replay is not its original
        if self.role == "producer":
            sock = getattr(self.sessions, "router", None)
            parts = [sender.encode(), frame]
        else:
            sock = self.sessions.conns.get(_address(sender))
            parts = [frame]
        if sock is None or sock.closed:
            self.sim.stats["frames_to_closed"] += 1
            return
        self._attack[id(frame)] = frame
        sock.inbox.append(parts)
        self.wake()

    # -- the engine's connections (consumer) -------------------------------------------
    def connect(self, producer: str) -> None:
        """Keep ``producer`` dialled (and again after it is lost), as an engine that
        connects to every producer would."""
        self.dialing.add(_address(producer))
        self.run(self._redial)

    def _redial(self) -> None:
        if not self.open:
            return
        for address in sorted(self.dialing):
            if address not in self.dialers.by_address:
                self._dial(address, None)

    def _dial(self, address: str, producer: str | None) -> None:
        """The engine's ``connect(address)``; ``producer``: the one it means (checked)."""
        call = next(self._calls)
        if producer is not None:
            self.waiters[call] = (producer, address, self.sim.sched.now)

        def answered(name: str | None, error: Any) -> None:
            self.waiters.pop(call, None)
            if producer is not None and error is None and name != producer:
                self.sim.checker.fail("connect_wrong_peer", f"{self.name}: connect() to "
                                      f"{producer} at {address} returned {name!r}")
        sim = self.sim
        fresh = address not in self.dialers.by_address
        self.sessions.connect(address, math.inf, answered)
        if fresh and sim.faults.on("twin") and address == _address(sim.producer_at(address)) \
                and sim.rng.random() < sim.faults.twin_p:
            # the engine dials another spelling while this one's handshake goes on
            sim.sched.after(sim.rng.uniform(0, 4e-3), sim.dial_twin, self,
                            sim.producer_at(address))

    def connect_twin(self, producer: str, address: str, keep: bool) -> None:
        """The engine's ``connect(address)``, ``address`` another spelling of a producer
        this side has a session with (or is dialling). ``keep``: dialled again after a
        loss, with the first spelling (the two then race through the handshake)."""
        if keep:
            self.dialing.add(address)
        self._dial(address, producer)

    def unresolved(self, before: float) -> list[str]:
        """Consumer: connect() calls made before ``before`` and not answered."""
        return [f"{p} at {a} since t={t:.3f}" for p, a, t in self.waiters.values()
                if t < before]

    def identify(self, sock: wire.Socket) -> bytes:
        """A connection's routing identity: ``c1/3.7``, the 7th of incarnation 3 of c1."""
        return f"{self.name}/{self.inc}.{next(self._conns)}".encode()

    # -- watching ----------------------------------------------------------------------
    def _watch(self) -> None:
        """Observers on the real session machines, sessions and core: the checks below run
        on what they do, and change nothing of it."""
        machine = self.sessions.machine
        receive = machine.receive
        carry_out = self.sessions._carry_out
        on_message = self.core.on_message

        def watched_receive(now: float, peer: Any, frame: Any) -> Any:
            obj = getattr(frame, "obj", frame)
            self._attacked = self._attack.get(id(obj)) is obj
            if self._attacked:
                del self._attack[id(obj)]
            result = receive(now, peer, frame)
            effects = result[0]
            if self.role == "consumer":
                self._check_restart(effects, peer.address)
            else:
                self._check_restart(effects, own=peer)
            self._check_effects(effects)
            got = result[1]
            if self._attacked and got is not None:
                msg = got[1] if self.role == "producer" else got
                self.sim.checker.fail("forged_accepted", f"{self.name} took {_brief(msg)} "
                                      f"from an attacker")
            self._attacked = False   # (what the machine took from it is ``got``, checked)
            return result

        def watched_carry_out(effects: list[SessionEffect]) -> None:
            for eff in effects:
                if isinstance(eff, Transmit) and isinstance(eff.msg, m.Hello):
                    self._check_one_connection(str(eff.peer))
                elif isinstance(eff, Admit) and self.role == "producer":
                    assert isinstance(eff.peer, bytes)
                    if eff.peer.decode().partition("/")[0] != eff.name:
                        self.sim.checker.fail("hello_forged", f"{self.name} admits {eff.name}"
                                              f" on the connection of {eff.peer.decode()}")
                elif isinstance(eff, PeerUp):
                    self.sim.checker.trace(f"{self.name} up {eff.name}")
                elif isinstance(eff, PeerDown):
                    self.sim.checker.trace(f"{self.name} lost {eff.name}: {eff.why}")
                elif isinstance(eff, ConnectFailed) and not self.closing:
                    # A handshake given a deadline (a rejoin after the data plane
                    # restarted) may run out of time while its producer is down, and one
                    # under way when this side's data plane dies ends; one that ends
                    # otherwise was refused, which no producer here has cause to do.
                    if eff.timed_out or self._losing_plane:
                        self.sim.checker.trace(f"{self.name} dial {eff.address} timed out")
                    else:
                        self.sim.checker.fail("hello_rejected", f"{eff.address} refused "
                                              f"{self.name}: {eff.error}")
            carry_out(effects)
            if self.role == "consumer" and any(isinstance(e, (PeerDown, ConnectFailed))
                                               for e in effects):
                self.sim.sched.after(0.0, self.run, self._redial)

        def watched_on_message(now: float, peer: str, msg: Any, *rest: Any) -> Any:
            self.sim.checker.trace(f"{self.name} < {peer} {_brief(msg)}")
            if isinstance(msg, (m.Register, m.Claim)):
                self.sim.producer_wait_started(msg.request_id)
            if isinstance(msg, m.Claim):     # it may hold a source up to max_wait_s
                taken = on_message(now, peer, msg, *rest)
                # Which use the core gave it to, if any: a push claim that comes while a
                # use is held waits for that use's release and joins the next one (the
                # core takes it again then, before the engine hears of the release).
                self.engine.took_claim(now, peer, msg, self.core.snapshot(msg.request_id))
                return taken
            if isinstance(msg, (m.Register, m.PullBegin)):   # a claim of it continues
                self.engine.claim_gone(now, peer, msg.request_id, msg.xid)
            return on_message(now, peer, msg, *rest)

        machine.receive = watched_receive
        self.sessions._carry_out = watched_carry_out
        self.core.on_message = watched_on_message
        try_send = self.driver.try_send

        def watched_try_send(sock: Any, frame: bytes, identity: bytes | None) -> bool:
            box = self.driver._outbox.get((sock, identity))
            if box and box[0] is not frame:
                self.sim.checker.fail("frame_overtook_outbox", f"{self.name}: a control "
                                      f"frame sent ahead of {len(box)} queued before it "
                                      f"for {identity or sock.address!r}")
            return try_send(sock, frame, identity)
        self.driver.try_send = watched_try_send  # type: ignore[method-assign]
        if self.role == "producer":
            check = machine.check
            send = self.sessions.send

            def watched_send(peer: str, msg: m.Message) -> None:
                # A PullHeld's hold counts from the core's answer (its hold timer starts
                # then), however long the frame then waits in the outbox.
                if isinstance(msg, m.PullHeld):
                    src_rec = self.engine.sources.get(msg.request_id)
                    if src_rec is not None:
                        src_rec.held_until[msg.xid] = self.sim.sched.now + msg.hold_s
                send(peer, msg)
            self.sessions.send = watched_send

            def watched_check(now: float) -> Any:
                effects = check(now)
                self._check_silence(now)
                return effects
            machine.check = watched_check
        else:
            join = self.sessions._join

            def watched_join(d: Any, twin: Any) -> None:
                self.sim.stats["twin_joined" if twin.up else "twin_joined_dialling"] += 1
                self.sim.checker.trace(f"{self.name} joins {d.address} to {twin.address} "
                                       f"({twin.state.value})")
                join(d, twin)
            self.sessions._join = watched_join

    def _watch_liveness(self) -> None:
        """Every ``peer_timeout_s / 4`` (how often a producer judges its consumers): no
        consumer silent for ``peer_timeout_s`` outlives the next of those checks, unless this
        process was stalled since. Whether its loop runs the check at all is what this
        watches (a check that never runs judges nobody)."""
        t = self.sim.timings
        every = t.peer_timeout_s / 4
        now = self.sim.sched.now
        if not self.alive:
            return
        self.sim.sched.after(every, self._watch_liveness)
        if now < self.stalled_until + every + 1e-3:
            return
        kept = self._silent(now, t.peer_timeout_s + every + 1e-3)
        if kept:
            self.sim.checker.fail("silence_not_judged",
                                  f"{self.name}: sessions up past peer_timeout_s of silence "
                                  f"and its next liveness check: {kept[:3]}")

    def _check_effects(self, effects: list[SessionEffect]) -> None:
        """An attacker's frame may earn a refusal (sent best effort, or a handshake frame
        sent again) and nothing else."""
        if not self._attacked:
            return
        for eff in effects:
            if not (isinstance(eff, Transmit) and (eff.best_effort or eff.again)):
                what = _brief(eff.msg) if isinstance(eff, Transmit) else f"{eff!r:.200}"
                self.sim.checker.fail("forged_accepted", f"{self.name}: an attacker's frame "
                                      f"made the session do {what}")

    def _check_one_connection(self, address: str) -> None:
        """A Hello goes out on ``address`` only while no other session of this consumer
        reaches the same producer (its name and instance, from the Challenge) past its
        probe: one connection per producer, however its address is spelt."""
        d = self.dialers.by_address.get(address)
        if d is None or d.address != address:
            return
        live = (DialState.HELLO, DialState.ADMITTING, DialState.UP)
        for other in self.dialers:
            if other is not d and other.state in live and other.name == d.name \
                    and other.instance == d.instance:
                self.sim.checker.fail("two_connections", f"{self.name} says Hello to "
                                      f"{d.name} at {address} while its session at "
                                      f"{other.address} is {other.state.value}")
                return

    def _check_restart(self, effects: list[SessionEffect], address: str = "",
                       own: bytes = b"") -> None:
        """A frame makes a session end a peer's other session (a producer: the consumer
        says Hello anew; a consumer: the producer answers at ``address`` under a name
        connected elsewhere) only when that peer restarted, or dials again after losing
        its session: never because a second spelling of an address was dialled. (A
        producer also ends the session of connection ``own``, the frame's, when the frame
        came so late that the consumer may have given it up: no restart.)"""
        sim = self.sim
        for eff in effects:
            if not isinstance(eff, PeerDown) or not eff.conn or eff.conn == address:
                continue
            if own and eff.conn == own and not eff.abandon:
                continue
            if self.role == "consumer":   # the producer taken for restarted
                ep = sim.endpoints.get(eff.name)
                if ep is not None and ep.inc == self.agent.peers.get(eff.name, (-1, 0))[0]:
                    sim.checker.fail("false_restart", f"{self.name} takes {eff.name}#{ep.inc}"
                                     f" for restarted ({eff.why}); it runs as it did")
                continue
            ident = eff.conn.decode() if isinstance(eff.conn, bytes) else eff.conn
            name, _, conn = ident.partition("/")
            ce = sim.endpoints.get(name)
            if ce is None or not ce.alive or ce.role != "consumer" \
                    or conn.partition(".")[0] != str(ce.inc):
                continue   # a consumer that restarted
            sock = next((s for s in ce.ctx.sockets
                         if not s.closed and s.identity == ident.encode()), None)
            if sock is None:
                continue   # that connection is closed: its session ended
            d = ce.dialers.by_address.get(sock.address)
            if d is not None and d.address == sock.address and d.state is not DialState.DOWN:
                sim.checker.fail("false_restart", f"{self.name} drops {ident} ({eff.why}) "
                                 f"while {name} holds that session {d.state.value}")

    def _silent(self, now: float, over: float) -> list[str]:
        """The producer's consumer sessions up though silent for more than ``over``
        seconds (a dropped session has left ``consumers`` already)."""
        return [f"{p.name} (silent since t={p.last_seen:.3f})"
                for p in self.sessions.machine.consumers.values()
                if p.state is Link.UP and now - p.last_seen > over]

    def _check_silence(self, now: float) -> None:
        """After a liveness check no consumer silent for peer_timeout_s is still up: one
        that is may be gone for good, and its session, claims and transfers would be held
        for ever."""
        kept = self._silent(now, self.sim.timings.peer_timeout_s)
        if kept:
            self.sim.checker.fail("silence_not_judged",
                                  f"{self.name}: sessions kept up past peer_timeout_s of "
                                  f"silence by its liveness check: {kept[:3]}")


def _host(address: str) -> str:
    return address.partition("://")[2].rpartition(":")[0]


def _address(producer: str) -> str:
    """The address consumers dial ``producer`` at (every producer listens on one port)."""
    return f"tcp://{producer}:{_PORT}"


def spellings(producer: str, index: int) -> tuple[str, ...]:
    """The addresses that reach ``producer`` (the ``index``-th): the host name consumers
    dial, its IP, and a fully qualified name (another spelling a consumer may dial)."""
    return (_address(producer), f"tcp://10.0.{index // 250}.{index % 250 + 1}:{_PORT}",
            f"tcp://{producer}.sim.internal:{_PORT}")


def _meta(name: str, inc: int, generation: int) -> bytes:
    return f"{name}#{inc}#{generation}".encode()


def _inc(meta: bytes) -> int:
    try:
        return int(meta.split(b"#")[1])
    except (IndexError, ValueError):
        return -1


def _generation(meta: bytes) -> int:
    try:
        return int(meta.split(b"#")[2])
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
