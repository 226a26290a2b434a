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
from typing import TYPE_CHECKING, Any

from .. import messages as m
from ..errors import AuthenticationError, PeerUnavailable, ProtocolError
from ..layout import KVLayout
from ..protocol.effects import Abandon, ClaimGone, Dial, DropPeer, Emit, Post, Send, XferEnd
from ..protocol.session import (
    AcceptConfig,
    Acceptor,
    Admit,
    ConnectFailed,
    DialConfig,
    Dialer,
    Dialers,
    DialState,
    Link,
    PeerDown,
    PeerUp,
    SessionEffect,
    SessionStats,
    Transmit,
)
from ..request import Release, TransferResult
from .engines import DecodeEngine, PrefillEngine
from .fakes import FakeMemory, SimLinks, Transfer

if TYPE_CHECKING:
    from .sim import Simulation

__all__ = ["Endpoint", "spellings"]

_IDEMPOTENT = (m.Probe, m.Challenge, m.Hello, m.HelloAck, m.Heartbeat, m.HeartbeatAck)


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
        # The peer sessions: the real session machines (kvpush.protocol.session), over the
        # simulated network, with the run's key (or none) and seeded nonces.
        self.clock_skew = 0.0        # this process's wall clock minus simulated time
        self.session_stats = SessionStats()
        self._attack = False         # the frame being handled is an attacker's
        self.peer_inc: dict[str, int] = {}   # each peer's incarnation, as last admitted
        self.dialing: set[str] = set()       # consumer: addresses it keeps connected
        self.idents: dict[str, str] = {}     # consumer: address -> its socket's identity
        self.conn_address: dict[str, str] = {}   # consumer: socket identity -> address
        # consumer: the engine's connect() calls not answered yet, by the address whose
        # session answers them: (the producer the address reaches, when called)
        self.waiters: dict[str, list[tuple[str, float]]] = {}
        # consumer: the core's Dials not answered yet (by address): when each runs out
        self.dials: dict[str, list[float]] = {}
        self._conns = 0
        self._dial_armed = math.inf

        def wall() -> float:
            return sim.sched.now + self.clock_skew

        if role == "producer":
            # bound to every interface and dialled by a host name, so only the challenge
            # tells a Hello meant for this producer from one meant for another
            self.acceptor = Acceptor(AcceptConfig(name, self.layout, sim.auth_key,
                                                  t.peer_timeout_s, _address(name),
                                                  "tcp://0.0.0.0:5555", wall, sim.nonce),
                                     lambda: _meta(name, inc), self.session_stats)
        else:
            self.dialers = Dialers(DialConfig(name, self.layout, sim.auth_key,
                                              t.peer_timeout_s, t.hello_retry_s, 0.5, wall,
                                              sim.nonce))
        self.xfers: dict[int, Transfer] = {}      # posted here, end not yet reported
        self.closing = False
        self.stalled_until = 0.0
        self.stall_total = 0.0
        self._stall_start = 0.0
        self.backlog: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._armed = math.inf
        self._same_deadline = 0
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
        if self.role == "producer":
            for tx in self.acceptor.close():
                self._transmit(tx)
        else:
            for d in self.dialers:
                if d.up:
                    self._transmit(Transmit(d.address, d.seal(m.Bye(self.name)),
                                            msg=m.Bye(self.name)))
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
        """A core's Send: sealed under the peer's session (dropped when not connected, as
        the facades do)."""
        if self.role == "producer":
            tx = self.acceptor.seal(peer, msg)
        else:
            d = self.dialers.by_name.get(peer)
            tx = None if d is None or not d.up else Transmit(d.address, d.seal(msg), msg=msg)
        if tx is not None:
            self._transmit(tx)

    def _transmit(self, tx: Transmit) -> None:
        """Send a frame on a connection. A consumer's connection to one producer is one
        ZeroMQ socket with a routing identity of its own (``name/incarnation.n``): what the
        producer sends to an identity whose socket was closed (a session that ended, or a
        consumer that restarted) is lost, as in ZeroMQ."""
        msg = tx.msg
        if isinstance(tx.peer, bytes):          # producer -> a consumer connection
            ident = tx.peer.decode()
            peer = ident.partition("/")[0]
        else:                                   # consumer -> the producer it dialled
            peer = self.sim.producer_at(tx.peer)
            ident = self.idents.get(tx.peer, "")
            if isinstance(msg, m.Hello):
                self._check_one_connection(tx.peer)
        target = self.sim.endpoints.get(peer)
        if target is None or not ident:
            return
        idempotent = isinstance(msg, _IDEMPOTENT)
        if not idempotent:
            self.sim.checker.trace(f"{self.name} > {peer} {_brief(msg)}")
        if isinstance(msg, m.PullHeld) and self.role == "producer":
            src = self.engine.sources.get(msg.request_id)
            if src is not None:
                src.held_until[msg.xid] = self.sim.sched.now + msg.hold_s
        # what an attacker captures: frames once delivered (a copy that overtook the
        # original would only deliver the genuine frame early)
        hello = isinstance(msg, m.Hello)
        if self.role == "producer":
            def deliver(sender: str, frame: bytes) -> None:
                self.sim.sent_frame(sender, peer, frame)
                target.receive(sender, frame, ident)
        else:
            def deliver(sender: str, frame: bytes) -> None:
                self.sim.sent_frame(ident, peer, frame, hello)
                target.receive(ident, frame)
        self.sim.net.send(self.name, peer, tx.frame, deliver, idempotent)

    def receive(self, sender: str, frame: bytes, conn: str = "") -> None:
        """A frame from ``sender`` (producer: a consumer connection's identity; consumer:
        the producer's name, on connection ``conn``)."""
        self.run(self._on_frame, sender, frame, conn, False)

    def attacked(self, sender: str, frame: bytes) -> None:
        """A frame from an attacker (forged, replayed or spliced into a live connection):
        with a key, it may earn a refusal and nothing else."""
        self.run(self._on_frame, sender, frame, "", True)

    def _on_frame(self, sender: str, frame: bytes, conn: str, attack: bool) -> None:
        now = self.sim.sched.now
        self._attack = attack
        try:
            if self.role == "producer":
                effects, got = self.acceptor.receive(now, sender.encode(), frame)
                self._check_restart(effects)
            else:
                # the socket's address (an attacker's frame: the producer's host name)
                address = self.conn_address.get(conn, "") if conn else _address(sender)
                d = self.dialers.by_address.get(address)
                if d is None or d.address != address \
                        or (conn and self.idents.get(address) != conn):
                    self.sim.stats["frames_to_closed"] += 1   # its socket is gone
                    return
                try:
                    effects, msg = self.dialers.receive(now, d, frame)
                except (AuthenticationError, ProtocolError):
                    self.sim.stats["frames_rejected"] += 1
                    return
                twin = self.dialers.by_address.get(address)
                if twin is not None and twin is not d:
                    self._join(d, twin)
                    return
                self._check_restart(effects, address)
                got = None if msg is None else (d.name, msg)
            self._session(effects)
            if got is None:
                return
            if attack:
                self.sim.checker.fail("forged_accepted", f"{self.name} took {_brief(got[1])} "
                                      f"from attacker {sender} as {got[0]}'s")
                return
            name, msg = got
            if isinstance(msg, m.Heartbeat):
                if self.sim.timings.heartbeats_to_core:
                    self.core.on_message(now, name, msg)
                return
            self.sim.checker.trace(f"{self.name} < {name} {_brief(msg)}")
            if isinstance(msg, (m.Register, m.Claim)):
                self.sim.producer_wait_started(msg.request_id)
            if isinstance(msg, m.Claim):     # it may hold the source up to max_wait_s
                src = self.engine.sources.get(msg.request_id)
                if src is not None:
                    src.claimed_at = now
            self.core.on_message(now, name, msg)
        finally:
            self._attack = False

    def _session(self, effects: list[SessionEffect]) -> None:
        """Carry out what a session machine asked, in order."""
        now = self.sim.sched.now
        for eff in effects:
            if self._attack and not (isinstance(eff, Transmit)
                                     and (eff.best_effort or eff.again)):
                what = _brief(eff.msg) if isinstance(eff, Transmit) else f"{eff!r:.200}"
                self.sim.checker.fail("forged_accepted", f"{self.name}: an attacker's frame "
                                      f"made the session do {what}")
            if isinstance(eff, Transmit):
                self._transmit(eff)
            elif isinstance(eff, Admit):
                self._admit(now, eff)
            elif isinstance(eff, PeerUp):
                self.sim.checker.trace(f"{self.name} up {eff.name}")
                if self.role == "producer":
                    self.core.peer_up(now, eff.name, eff.layout)
                else:
                    self.core.peer_up(now, eff.name)   # the consumer core takes no layout
                    d = self.dialers.by_name.get(eff.name)
                    if d is not None:
                        self._resolve(d.address, eff.name)
                    self._answer_dials()
                self.flush()
            elif isinstance(eff, PeerDown):
                self.sim.checker.trace(f"{self.name} lost {eff.name}: {eff.why}")
                if self.role == "producer":
                    self.core.peer_lost(now, eff.name, eff.why, abandon=eff.abandon)
                else:
                    self.core.peer_lost(now, eff.name, eff.why)
                self.flush()
            elif isinstance(eff, ConnectFailed):
                self._drop_conn(eff.address)
                self.waiters.pop(eff.address, None)   # (their failure is reported here)
                if not self.closing:
                    self.sim.checker.fail("hello_rejected", f"{eff.address} refused "
                                          f"{self.name}: {eff.error}")
        if self.role == "consumer":
            self._redial()

    def _admit(self, now: float, eff: Admit) -> None:
        """The fake agent takes the peer's metadata (``name#incarnation``)."""
        agent = eff.metadata.rsplit(b"#", 1)[0].decode(errors="replace")
        self.peer_inc[eff.name] = _inc(eff.metadata)
        if self.role == "producer":
            assert isinstance(eff.peer, bytes)
            if eff.peer.decode().partition("/")[0] != eff.name:
                self.sim.checker.fail("hello_forged", f"{self.name} admits {eff.name} on "
                                      f"the connection of {eff.peer.decode()}")
            self._session(self.acceptor.admitted(now, eff.peer, agent))
        else:
            d = self.dialers.by_address.get(str(eff.peer))
            if d is None:
                return
            if agent != eff.name:
                self._session(self.dialers.refused(now, d, ProtocolError("agent name")))
            else:
                self._session(self.dialers.admitted(now, d))

    # -- connections and liveness ------------------------------------------------------
    def connect(self, producer: str) -> None:
        """Consumer: keep dialling ``producer`` (and again after it is lost), as an engine
        that connects to every producer would."""
        self.dialing.add(_address(producer))
        self.sim.sched.after(0.0, self.run, self._redial)

    def connect_twin(self, producer: str, address: str, keep: bool) -> None:
        """Consumer: the engine's ``connect(address)``, ``address`` another spelling of a
        producer this side has a session with (or is dialling), as the real consumer's
        ``connect()`` does it: answered at once by a session up at that address, else a new
        socket and session, or the one dialling there already. ``keep``: dialled again after a loss,
        with the first spelling (the two then race through the handshake)."""
        if keep:
            self.dialing.add(address)
        waiter = (producer, self.sim.sched.now)
        d = self.dialers.by_address.get(address)
        if d is not None and d.up:
            self._answer([waiter], address, d.name)
            return
        if d is None:
            self._dial(address)
            d = self.dialers.by_address.get(address)
        if d is not None:   # (the session that answers: a joined spelling's is its twin)
            self.waiters.setdefault(d.address, []).append(waiter)

    def _dial(self, address: str) -> None:
        """A new socket (a new routing identity) and session for ``address``."""
        self._drop_conn(address)   # (the socket of a session that ended)
        self._conns += 1
        ident = f"{self.name}/{self.inc}.{self._conns}"
        self.idents[address] = ident
        self.conn_address[ident] = address
        _, effects = self.dialers.dial(self.sim.sched.now, address, _meta(self.name, self.inc),
                                       math.inf)
        sim = self.sim
        if sim.faults.on("twin") and address == _address(sim.producer_at(address)) \
                and sim.rng.random() < sim.faults.twin_p:
            # the engine dials another spelling while this one's handshake goes on
            sim.sched.after(sim.rng.uniform(0, 4e-3), sim.dial_twin, self,
                            sim.producer_at(address))
        self._session(effects)

    def _join(self, d: Dialer, twin: Dialer) -> None:
        """``d``'s address reaches the producer of ``twin``'s session (as the real
        consumer joins them): its socket goes, its waiters wait on the twin."""
        self.sim.stats["twin_joined" if twin.up else "twin_joined_dialling"] += 1
        self.sim.checker.trace(f"{self.name} joins {d.address} to {twin.address} "
                               f"({twin.state.value})")
        self._drop_conn(d.address)
        if twin.up:
            self._answer(self.waiters.pop(d.address, []), d.address, twin.name)
        elif d.address in self.waiters:
            self.waiters.setdefault(twin.address, []).extend(self.waiters.pop(d.address))

    def _drop_conn(self, address: str) -> None:
        ident = self.idents.pop(address, None)
        if ident is not None:
            self.conn_address.pop(ident, None)

    def _core_dial(self, eff: Dial) -> None:
        """The core's Dial (a pull or a claim whose producer is not connected), answered as
        :meth:`kvpush.sessions.Dialing.dial` answers it: once the session at the address is
        up (at once if it is), else with PeerUnavailable when the Dial's time runs out. The
        engine keeps every producer dialled, so no session is started here."""
        self.sim.checker.trace(f"{self.name} dial {eff.address} for {eff.timeout:.3f} s")
        self.dials.setdefault(eff.address, []).append(self.sim.sched.now + eff.timeout)
        self.sim.sched.after(0.0, self.run, self._answer_dials)
        self.sim.sched.after(eff.timeout, self.run, self._answer_dials)

    def _answer_dials(self) -> None:
        """Answer the core's Dials whose session is up, and those whose time ran out."""
        now = self.sim.sched.now
        for address, due in list(self.dials.items()):
            d = self.dialers.by_address.get(address)
            up = d is not None and d.up
            over = [t for t in due if up or t <= now]
            self.dials[address] = [t for t in due if t not in over]
            if not self.dials[address]:
                del self.dials[address]
            for _ in over:
                self.sim.checker.trace(f"{self.name} dialed {address}: "
                                       f"{d.name if up and d else 'timed out'}")
                self.core.dialed(now, address, d.name if up and d else None, None if up else
                                 PeerUnavailable(f"no session with {address} in time"))

    def _resolve(self, address: str, name: str) -> None:
        """The session at ``address`` is up with producer ``name``."""
        self._answer(self.waiters.pop(address, []), address, name)

    def _answer(self, waiters: list[tuple[str, float]], address: str, name: str) -> None:
        """connect() calls return ``name``: the producer each dialled, whatever spelling
        of its address it used."""
        for producer, _ in waiters:
            if producer != name:
                self.sim.checker.fail("connect_wrong_peer", f"{self.name}: connect() to "
                                      f"{producer} at {address} returned {name!r}")

    def unresolved(self, before: float) -> list[str]:
        """Consumer: connect() calls made before ``before`` and not answered."""
        return [f"{p} at {a} since t={t:.3f}" for a, ws in self.waiters.items()
                for p, t in ws if t < before]

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

    def _check_restart(self, effects: list[SessionEffect], address: str = "") -> None:
        """A frame makes a session end a peer's other session (a producer: the consumer
        says Hello anew; a consumer: the producer answers at ``address`` under a name
        connected elsewhere) only when that peer restarted, or dials again after losing
        its session: never because a second spelling of an address was dialled."""
        sim = self.sim
        for eff in effects:
            if not isinstance(eff, PeerDown) or not eff.conn or eff.conn == address:
                continue
            if self.role == "consumer":   # the producer taken for restarted
                ep = sim.endpoints.get(eff.name)
                if ep is not None and ep.inc == self.peer_inc.get(eff.name):
                    sim.checker.fail("false_restart", f"{self.name} takes {eff.name}#{ep.inc}"
                                     f" for restarted ({eff.why}); it runs as it did")
                continue
            ident = eff.conn.decode() if isinstance(eff.conn, bytes) else eff.conn
            name, _, conn = ident.partition("/")
            ce = sim.endpoints.get(name)
            if ce is None or not ce.alive or ce.role != "consumer" \
                    or conn.partition(".")[0] != str(ce.inc):
                continue   # a consumer that restarted
            conn_address = ce.conn_address.get(ident, "")
            d = ce.dialers.by_address.get(conn_address)
            if d is not None and d.address == conn_address and d.state is not DialState.DOWN:
                sim.checker.fail("false_restart", f"{self.name} drops {ident} ({eff.why}) "
                                 f"while {name} holds that session {d.state.value}")

    def _redial(self) -> None:
        if not self.open:
            return
        for address in sorted(self.dialing):
            if address not in self.dialers.by_address:
                self._dial(address)
        due = self.dialers.next_deadline()
        if due is not None and due < self._dial_armed:
            self._dial_armed = due
            self.sim.sched.at(due, self.run, self._dial_tick, due)

    def _dial_tick(self, due: float) -> None:
        if due != self._dial_armed:
            return
        self._dial_armed = math.inf
        self._session(self.dialers.tick(self.sim.sched.now))

    def start_liveness(self) -> None:
        self.sim.sched.after(self.sim.sched.rng.uniform(0, self.sim.timings.heartbeat_s),
                             self.run, self._liveness)

    def _liveness(self) -> None:
        now = self.sim.sched.now
        if self.role == "producer":
            self._session(self.acceptor.check(now))
            self._check_silence(now)
        else:
            self._session(self.dialers.heartbeat(now))
        self.sim.sched.after(self.sim.timings.heartbeat_s, self.run, self._liveness)

    def _check_silence(self, now: float) -> None:
        """After a liveness check no consumer silent for peer_timeout_s is still up: one
        that is may be gone for good, and its session, claims and transfers would be held
        for ever."""
        t = self.sim.timings
        kept = [f"{p.name} (silent since t={p.last_seen:.3f})"
                for p in self.acceptor.consumers.values()
                if p.state is Link.UP and now - p.last_seen > t.peer_timeout_s]
        if kept:
            self.sim.checker.fail("silence_not_judged",
                                  f"{self.name}: sessions kept up past peer_timeout_s of "
                                  f"silence by its liveness check: {kept[:3]}")

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
            elif isinstance(eff.item, ClaimGone) and self.role == "consumer":
                self.sim.checker.trace(f"{self.name} claim gone {eff.item.request_id} "
                                       f"xid={eff.item.xid:x}")
            else:
                self.sim.checker.fail("bad_effect", f"{self.name}: {eff!r}")
        elif isinstance(eff, Dial) and self.role == "consumer":
            self._core_dial(eff)
        elif isinstance(eff, DropPeer):
            self.sim.checker.trace(f"{self.name} drop {eff.peer}: {eff.why}")
            if self.role == "producer":
                self.acceptor.forget(eff.peer)
            else:
                d = self.dialers.by_name.get(eff.peer)
                if d is not None:
                    self._session([e for e in self.dialers.lose(self.sim.sched.now, d, eff.why)
                                   if not isinstance(e, PeerDown)])
        else:
            self.sim.checker.fail("bad_effect", f"{self.name}: unknown effect {eff!r}")

    def _post(self, eff: Post) -> None:
        sim = self.sim
        now = sim.sched.now
        if eff.key in self.xfers:
            sim.checker.fail("bad_effect", f"{self.name}: transfer key {eff.key} posted twice")
            return
        sealer = self._notif_sealer(eff.peer)
        target = sim.endpoints.get(eff.peer)
        if sealer is False or target is None or not target.alive \
                or target.inc != self.peer_inc.get(eff.peer):
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
        notif = m.encode(eff.notif, sealer or None)
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

    def _notif_sealer(self, peer: str) -> Any:
        """The sealer of notifications to connected ``peer`` (None without a key), or
        False when it is not connected."""
        if self.role == "producer":
            p = self.acceptor.connected(peer)
            return False if p is None else p.notif_sealer
        d = self.dialers.by_name.get(peer)
        return False if d is None or not d.up else d.notif_sealer

    def notification(self, sender: str, frame: bytes) -> None:
        if self.role == "producer":
            p = self.acceptor.connected(sender)
            known, opener = p is not None, None if p is None else p.notif_opener
        else:
            d = self.dialers.by_name.get(sender)
            known = d is not None and d.up
            opener = None if d is None else d.notif_opener
        if not known:
            self.sim.stats["notifs_from_unknown"] += 1
            return
        try:
            msg = m.decode(frame, opener)
        except AuthenticationError:
            self.sim.stats["notifs_rejected"] += 1
            return
        self.sim.checker.trace(f"{self.name} notif < {sender} {_brief(msg)}")
        self.core.on_notification(self.sim.sched.now, sender, msg)


def _address(producer: str) -> str:
    """The address consumers dial ``producer`` at (every producer listens on one port)."""
    return f"tcp://{producer}:5555"


def spellings(producer: str, index: int) -> tuple[str, ...]:
    """The addresses that reach ``producer`` (the ``index``-th): the host name consumers
    dial, its IP, and a fully qualified name (another spelling a consumer may dial)."""
    return (_address(producer), f"tcp://10.0.{index // 250}.{index % 250 + 1}:5555",
            f"tcp://{producer}.sim.internal:5555")


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
