"""The peer sessions of an endpoint over ZeroMQ: the session machines of
:mod:`kvpush.protocol.session` (handshake, authentication, heartbeats, liveness,
incarnations, rejoin: the code the simulator runs too) with the sockets they speak over.

A :class:`~kvpush.driver.Driver` owns one of the two and calls it through
:class:`~kvpush.driver.Sessions`; each carries out its machine's effects (frames out, NIXL
taking a peer's metadata, the core told a peer is up or gone) on the driver's loop thread.

* :class:`Accepting` -- a producer's: one ROUTER socket that consumers dial.
* :class:`Dialing` -- a consumer's: one DEALER socket per producer, one session per
  producer however its address is spelt, and the ``connect()`` calls waiting on each.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import zmq

from . import messages as m
from .auth import Opener, Sealer
from .driver import (
    STRANGER_BYTES,
    STRANGER_FRAME_BYTES,
    STRANGER_PEER_BYTES,
    Driver,
    Timer,
    control_socket,
)
from .errors import (
    AuthenticationError,
    ClosedError,
    KvpushError,
    PeerUnavailable,
    ProtocolError,
)
from .layout import KVLayout
from .protocol.consumer import ConsumerCore
from .protocol.producer import ProducerCore
from .protocol.session import (
    AcceptConfig,
    Accepted,
    Acceptor,
    Admit,
    ConnectFailed,
    DialConfig,
    Dialer,
    Dialers,
    PeerDown,
    PeerUp,
    SessionEffect,
    Transmit,
)

__all__ = ["Accepting", "Dialing", "Waiter"]

log = logging.getLogger("kvpush.sessions")

#: Told a ``connect()``'s outcome: the producer's name, or the handshake's error.
Waiter = Callable[[str | None, KvpushError | None], None]


class Accepting:
    """A producer's sessions with its consumers, over the ROUTER socket it listens on.

    Raises :class:`~kvpush.errors.PeerUnavailable` when it cannot listen (the caller
    closes the driver)."""

    def __init__(self, driver: Driver, core: ProducerCore, *, host: str, port: int,
                 advertise: str | None, peer_timeout_s: float) -> None:
        self._driver = driver
        self._core = core
        self._peer_timeout_s = peer_timeout_s
        try:
            self.router = driver.ctx.socket(zmq.ROUTER)
            control_socket(self.router, peer_timeout_s)
            self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # A frame for a consumer that is not connected right now raises (and waits in
            # the outbox for its reconnection) instead of vanishing.
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.router.bind(f"tcp://{host}:{port or '*'}")
            self.bound: str = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            raise PeerUnavailable(f"cannot listen on {host}:{port}: {exc}") from exc
        self.address: str = self.bound if advertise is None else \
            f"tcp://{advertise}:{self.bound.rsplit(':', 1)[1]}"
        agent = driver.agent
        self.machine = Acceptor(AcceptConfig(
            driver.name, driver.layout, driver.key, peer_timeout_s, self.address,
            self.bound, wall=driver.wall, nonce=driver.nonce, wire=lambda: agent.layout),
            agent.metadata, driver.stats)
        driver.add_socket(self.router, self._on_router)
        driver.after(peer_timeout_s / 4, self._check_peers)

    @property
    def consumers(self) -> dict[bytes, Accepted]:
        """Connected consumers by connection identity."""
        return self.machine.consumers

    # -- what the driver asks (kvpush.driver.Sessions) ----------------------------------
    def send(self, peer: str, msg: m.Message) -> None:
        tx = self.machine.seal(peer, msg)
        if tx is not None:
            self._transmit(tx)

    def keys(self, peer: str) -> tuple[bool, Sealer | None, Opener | None]:
        consumer = self.machine.by_agent.get(peer)
        if consumer is None:
            return False, None, None
        return True, consumer.notif_sealer, consumer.notif_opener

    def forget(self, peer: str, why: str) -> None:
        """The core is done with ``peer``: its NIXL state goes (unless a newer connection
        under that name uses it)."""
        if self.machine.forget(peer):
            self._driver.agent.remove_peer(peer)

    def dial(self, address: str, timeout: float) -> None:
        raise RuntimeError("a producer dials no one (its core asks for no Dial)")

    def doubt(self, peer: str, now: float) -> str:
        """Why consumer ``peer`` may have given this producer up by ``now`` (see
        :meth:`kvpush.protocol.session.Acceptor.doubt`)."""
        return self.machine.doubt(peer, now)

    def distrust(self, peer: str, why: str) -> None:
        """Drop consumer ``peer``'s session for ``why`` (:meth:`doubt`), telling it to
        connect again."""
        consumer = self.machine.connected(peer)
        if consumer is not None:
            self._carry_out(self.machine.drop(consumer, why, rejoin=True))

    def unreachable(self, peer: str, why: str) -> None:
        consumer = self.machine.by_agent.get(peer)
        if consumer is not None:
            self.drop(consumer, why, abandon=True)

    def undeliverable(self, sock: zmq.Socket[Any], identity: bytes | None, why: str) -> None:
        consumer = self.machine.connected_at(identity) if identity is not None else None
        if consumer is not None:
            self.drop(consumer, why)

    def data_plane_lost(self, why: str) -> None:
        """Every consumer's requests fail, and each is told to connect again (it needs the
        new NIXL metadata)."""
        for consumer in list(self.machine.consumers.values()):
            self._carry_out(self.machine.drop(consumer, why, abandon=True, rejoin=True))

    def data_plane_restarted(self) -> None:
        """Nothing to do: the consumers told to rejoin dial again."""

    def close(self) -> None:
        for tx in self.machine.close():
            self._transmit(tx)
        self.machine.consumers.clear()

    # -- the socket --------------------------------------------------------------------
    def _on_router(self, sock: zmq.Socket[Any]) -> None:
        strangers = 0                   # bytes read this iteration from strangers,
        read: dict[bytes, int] = {}     # and from each of them
        for frames in self._driver.read_frames(sock):
            if len(frames) != 2:
                self._driver.stats.messages_rejected += 1
                continue
            identity, frame = frames[0].bytes, frames[1].buffer
            if self.machine.connected_at(identity) is None:
                # not authenticated: small frames, and few of them
                size = len(frame)
                spent = read.get(identity, 0) + size
                if size > STRANGER_FRAME_BYTES or spent > STRANGER_PEER_BYTES \
                        or strangers + size > STRANGER_BYTES:
                    self._driver.stats.messages_rejected += 1  # dropped unread
                    continue
                read[identity] = spent
                strangers += size
            effects, got = self.machine.receive(self._driver.clock(), identity, frame)
            self._carry_out(effects)
            if got is not None and not isinstance(got[1], m.Heartbeat):
                self._core.on_message(self._driver.clock(), got[0], got[1])
        self._driver.apply()

    def _carry_out(self, effects: list[SessionEffect]) -> None:
        """Carry out what the session machine asked, in order."""
        for effect in effects:
            if isinstance(effect, Transmit):
                self._transmit(effect)
            elif isinstance(effect, Admit):
                self._admit(effect)
            elif isinstance(effect, PeerUp):
                assert effect.layout is not None
                self._core.peer_up(self._driver.clock(), effect.name, effect.layout)
            elif isinstance(effect, PeerDown):
                if effect.conn:
                    log.info("%s: dropping consumer %s: %s", self._driver.name, effect.name,
                             effect.why)
                    assert isinstance(effect.conn, bytes)
                    self._driver.drop_outbox((self.router, effect.conn))
                self._core.peer_lost(self._driver.clock(), effect.name, effect.why,
                                     abandon=effect.abandon)
                self._driver.apply()

    def _transmit(self, tx: Transmit) -> None:
        assert isinstance(tx.peer, bytes)
        # An answer to a stranger is tried once, never queued; but one to a connection
        # whose earlier frames still wait in the outbox goes behind them (under the
        # outbox's bound, as any frame to it): frames to a connection leave in order.
        if tx.best_effort and not self._driver.queued(self.router, tx.peer):
            if not self._driver.try_send(self.router, tx.frame, tx.peer):
                log.info("%s: could not answer a stranger", self._driver.name)
        else:
            self._driver.send_frame(self.router, tx.frame, tx.peer)

    def _admit(self, admit: Admit) -> None:
        """A Hello checked by the session: NIXL takes the consumer's metadata (the HelloAck
        follows), or the Hello is refused."""
        assert isinstance(admit.peer, bytes)
        agent = self._driver.agent
        try:
            agent_name = agent.add_peer(admit.metadata, admit.layout, admit.name)
        except PeerUnavailable as exc:
            self._carry_out(self.machine.refuse(admit.peer, m.HelloReject(str(exc))))
            return
        if agent_name != admit.name:
            agent.remove_peer(agent_name)
        self._carry_out(self.machine.admitted(self._driver.clock(), admit.peer, agent_name))

    # -- liveness ----------------------------------------------------------------------
    def _check_peers(self) -> None:
        """Drop a consumer not heard from for ``peer_timeout_s``; what it sent while this
        loop could not read it (a stall) is read first, so a stalled loop does not take
        its own deafness for the consumer's silence."""
        self._driver.read_waiting()
        self._carry_out(self.machine.check(self._driver.clock()))
        self._driver.after(self._peer_timeout_s / 4, self._check_peers)

    def drop(self, consumer: Accepted, why: str, *, abandon: bool = False) -> None:
        """Forget a consumer's connection; the core ends what it had with it (its NIXL
        state goes once none of its WRITEs is in flight, see :meth:`forget`)."""
        self._carry_out(self.machine.drop(consumer, why, abandon=abandon))


class Dialing:
    """A consumer's sessions with its producers, one DEALER socket each."""

    def __init__(self, driver: Driver, core: ConsumerCore, *, peer_timeout_s: float,
                 heartbeat_s: float, connect_timeout_s: float) -> None:
        self._driver = driver
        self._core = core
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        agent = driver.agent
        self.machine = Dialers(DialConfig(driver.name, driver.layout, driver.key,
                                          peer_timeout_s, wall=driver.wall,
                                          nonce=driver.nonce, wire=lambda: agent.layout,
                                          heartbeat_s=heartbeat_s))
        # each session's socket and the connect() calls waiting on it, by its own address
        self.conns: dict[str, zmq.Socket[Any]] = {}
        self._waiters: dict[str, list[Waiter]] = {}
        self._dial_timer: Timer | None = None
        self._dial_due = math.inf
        self._rejoin_after: list[str] = []  # producers to handshake with again
        driver.after(heartbeat_s, self._heartbeat)

    def up(self, name: str) -> bool:
        """Whether producer ``name`` is connected now."""
        return name in self.machine.by_name

    def layout_of(self, name: str) -> KVLayout | None:
        """The layout producer ``name`` announced (None: not connected)."""
        d = self.machine.by_name.get(name)
        return None if d is None else d.layout

    def connect(self, address: str, timeout: float, on_result: Waiter) -> None:
        """Dial ``address`` (or join the session that already reaches it); ``on_result``
        gets the producer's name once the session is up, or the handshake's error, at the
        latest ``timeout`` from now (PeerUnavailable; a session other callers wait on
        goes on)."""
        d = self.machine.by_address.get(address)  # (a producer's every address dialled)
        if d is not None and d.up:
            on_result(d.name, None)
            return
        if d is None:
            sock = self._driver.ctx.socket(zmq.DEALER)
            control_socket(sock, self._peer_timeout_s)
            # A random routing identity per connection: no other peer can take this
            # connection over by connecting under the same identity (the producer knows a
            # restarted consumer by the name in its Hello).
            sock.setsockopt(zmq.IDENTITY, b"k" + self._driver.nonce()[:15])
            sock.connect(address)
            self.conns[address] = sock
            self._driver.add_socket(sock, self._handler(address, sock))
        now = self._driver.clock()
        d, effects = self.machine.dial(now, address, self._driver.agent.metadata,
                                       now + timeout)
        self._waiters.setdefault(d.address, []).append(self._bounded(address, timeout,
                                                                    on_result))
        self._carry_out(effects)

    def _bounded(self, address: str, timeout: float, on_result: Waiter) -> Waiter:
        """``on_result``, called once: with the session's outcome, or when ``timeout``
        passes first. A session already dialling keeps the deadline its first caller gave
        it, so a later caller's shorter one is kept here."""
        timer: Timer | None = None
        done = False

        def once(name: str | None, error: KvpushError | None) -> None:
            nonlocal done
            if done:
                return
            done = True
            if timer is not None:
                timer.cancel()
            on_result(name, error)

        def expire() -> None:
            for waiters in self._waiters.values():
                if once in waiters:
                    waiters.remove(once)
            once(None, PeerUnavailable(f"handshake with {address} did not finish in "
                                       f"{timeout:g} s"))

        if math.isfinite(timeout):
            timer = self._driver.after(timeout, expire)
        return once

    # -- what the driver asks (kvpush.driver.Sessions) ----------------------------------
    def send(self, peer: str, msg: m.Message) -> None:
        d = self.machine.by_name.get(peer)
        sock = self.conns.get(d.address) if d is not None and d.up else None
        if d is not None and sock is not None:
            self._driver.send_frame(sock, d.seal(msg))

    def keys(self, peer: str) -> tuple[bool, Sealer | None, Opener | None]:
        d = self.machine.by_name.get(peer)
        if d is None:
            return False, None, None
        return True, d.notif_sealer, d.notif_opener

    def forget(self, peer: str, why: str) -> None:
        """Never asked: this side drops a producer itself (:meth:`_lose`)."""

    def doubt(self, peer: str, now: float) -> str:
        """Never: a consumer's READ takes bytes from the producer, whose blocks are its own
        to keep (its PullHeld promise)."""
        return ""

    def distrust(self, peer: str, why: str) -> None:
        """Never asked (:meth:`doubt` finds none)."""

    def dial(self, address: str, timeout: float) -> None:
        """The core's Dial: connect, and tell the core how the handshake ended."""
        def dialed(name: str | None, error: KvpushError | None) -> None:
            self._driver.event(lambda now: self._core.dialed(now, address, name, error))

        self.connect(address, timeout, dialed)

    def unreachable(self, peer: str, why: str) -> None:
        """NIXL's word alone does not end a producer's session: its heartbeats do."""

    def undeliverable(self, sock: zmq.Socket[Any], identity: bytes | None, why: str) -> None:
        log.warning("%s: control frames to a producer undeliverable: %s", self._driver.name,
                    why)

    def data_plane_lost(self, why: str) -> None:
        self._rejoin_after = list(self.machine.by_address)
        now = self._driver.clock()
        for d in self.machine:  # (one still dialling: its Hello carried the lost metadata)
            self._carry_out(self.machine.lose(now, d, why))

    def data_plane_restarted(self) -> None:
        addresses, self._rejoin_after = self._rejoin_after, []
        self._rejoin(addresses)

    def close(self) -> None:
        for d in self.machine:
            sock = self.conns.get(d.address)
            if d.up and sock is not None:
                self._driver.send_frame(sock, d.seal(m.Bye(self._driver.name)))
        for waiters in list(self._waiters.values()):
            for waiter in waiters:
                waiter(None, ClosedError("consumer closed"))
        self._waiters.clear()
        if self._dial_timer is not None:
            self._dial_timer.cancel()
        self.machine.by_name.clear()
        self.machine.by_address.clear()

    # -- the sockets -------------------------------------------------------------------
    def _handler(self, address: str,
                 sock: zmq.Socket[Any]) -> Callable[[zmq.Socket[Any]], None]:
        return lambda _: self._on_dealer(address, sock)

    def _on_dealer(self, address: str, sock: zmq.Socket[Any]) -> None:
        driver = self._driver
        for frames in driver.read_frames(sock):
            d = self.machine.by_address.get(address)
            if d is None or d.address != address or self.conns.get(address) is not sock:
                return  # its session ended (or joined another address's)
            try:
                if len(frames) != 1:
                    raise ProtocolError("expected one frame")
                if not d.up and len(frames[0]) > STRANGER_FRAME_BYTES:
                    raise ProtocolError("handshake frame too large")  # dropped unread
                effects, msg = self.machine.receive(self._driver.clock(), d, frames[0].buffer)
            except AuthenticationError as exc:
                driver.stats.auth_rejected += 1
                log.warning("%s: rejected control frame: %s", driver.name, exc)
                continue
            except ProtocolError as exc:
                driver.stats.messages_rejected += 1
                log.warning("%s: rejected control frame: %s", driver.name, exc)
                continue
            twin = self.machine.by_address.get(address)
            if twin is not None and twin is not d:
                self._join(d, twin)
                return
            self._carry_out(effects)
            if msg is None:
                continue
            if isinstance(msg, (m.Posted, m.Failed, m.AbortAck, m.PullHeld, m.Abort)):
                self._core.on_message(self._driver.clock(), d.name, msg)
                driver.apply()
            else:
                driver.stats.messages_rejected += 1

    def _join(self, d: Dialer, twin: Dialer) -> None:
        """``d``'s address reaches the producer of ``twin``'s session (one connection per
        producer, however its address is spelt): its socket goes, its waiters wait on the
        twin."""
        self._drop_conn(d.address)
        waiters = self._waiters.pop(d.address, [])
        if twin.up:
            for waiter in waiters:
                waiter(twin.name, None)
        else:
            self._waiters.setdefault(twin.address, []).extend(waiters)

    def _carry_out(self, effects: list[SessionEffect]) -> None:
        """Carry out what the session machines asked, in order."""
        for effect in effects:
            if isinstance(effect, Transmit):
                sock = self.conns.get(str(effect.peer))
                if sock is not None:
                    self._driver.send_frame(sock, effect.frame)
            elif isinstance(effect, Admit):
                self._admit(effect)
            elif isinstance(effect, PeerUp):
                d = self.machine.by_name.get(effect.name)
                self._core.peer_up(self._driver.clock(), effect.name,
                                   d.layout if d is not None else None)
                if d is not None:
                    self._resolve(d.address, effect.name, None)
            elif isinstance(effect, PeerDown):
                self._lose(effect)
            elif isinstance(effect, ConnectFailed):
                self._drop_conn(effect.address)
                self._resolve(effect.address, None, effect.error)
        self._arm_dial_timer()

    def _admit(self, admit: Admit) -> None:
        """The producer's HelloAck checked by the session: NIXL takes its metadata, or the
        handshake fails with NIXL's error."""
        d = self.machine.by_address.get(str(admit.peer))
        if d is None:
            return
        agent = self._driver.agent
        try:
            name = agent.add_peer(admit.metadata, admit.layout, admit.name)
        except KvpushError as exc:
            self._carry_out(self.machine.refused(self._driver.clock(), d, exc))
            return
        if name != admit.name:
            agent.remove_peer(name)
            self._carry_out(self.machine.refused(self._driver.clock(), d, ProtocolError(
                f"producer calls itself {admit.name!r} but its NIXL agent is {name!r}")))
            return
        self._carry_out(self.machine.admitted(self._driver.clock(), d))

    def _resolve(self, address: str, name: str | None, error: KvpushError | None) -> None:
        for waiter in self._waiters.pop(address, []):
            waiter(name, error)

    def _drop_conn(self, address: str) -> None:
        sock = self.conns.pop(address, None)
        if sock is not None:
            self._driver.remove_socket(sock)

    def _arm_dial_timer(self) -> None:
        """One timer for every session's next retransmit or handshake deadline."""
        due = self.machine.next_deadline()
        if due is None or due >= self._dial_due:
            return
        if self._dial_timer is not None:
            self._dial_timer.cancel()
        self._dial_due = due
        self._dial_timer = self._driver.at(due, self._dial_tick)

    def _dial_tick(self) -> None:
        self._dial_timer, self._dial_due = None, math.inf
        self._carry_out(self.machine.tick(self._driver.clock()))

    # -- liveness ----------------------------------------------------------------------
    def _heartbeat(self) -> None:
        """Ask every producer whether it is there; the session loses one whose answer to a
        Heartbeat has not come ``peer_timeout_s`` after it was sent. Answers already
        waiting are read first, and the clock starts at a question: a loop that stalled
        longer than the timeout (a long NIXL call, the GIL, the process stopped) blames no
        producer for its own silence."""
        self._driver.read_waiting()
        self._carry_out(self.machine.heartbeat(self._driver.clock()))
        self._driver.after(self._heartbeat_s, self._heartbeat)

    def _lose(self, down: PeerDown) -> None:
        """A session that was up ended: its requests and claims fail, NIXL forgets the
        producer, and one that asked to be dialled again (its data plane restarted, or it
        was silent so long that this side may have given it up) is."""
        sock = self.conns.get(str(down.conn))
        unsent = " (control frames to it were still waiting to go out)" \
            if sock is not None and self._driver.queued(sock) else ""
        log.info("%s: lost producer %s: %s%s", self._driver.name, down.name, down.why, unsent)
        self._driver.stats.peers_lost += 1
        self._drop_conn(str(down.conn))
        self._core.peer_lost(self._driver.clock(), down.name, down.why)
        self._driver.apply()
        self._driver.agent.remove_peer(down.name)
        if down.rejoin:  # its NIXL metadata is new
            self._rejoin([str(down.conn)])

    def _rejoin(self, addresses: list[str]) -> None:
        """Handshake again with producers this side had (nobody waits for the answer)."""
        def result(name: str | None, error: KvpushError | None) -> None:
            if error is not None:
                log.warning("%s: reconnecting after a data-plane restart: %s",
                            self._driver.name, error)

        for address in addresses:
            self.connect(address, self._connect_timeout_s, result)
