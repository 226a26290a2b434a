"""Peer sessions: the handshake, authentication, liveness and departure of one control
connection, as sans-IO state machines (events in, effects out, the caller's clock).

Two machines, one per side of a connection, because the two sides do different things
with the same frames: the consumer dials (it probes, says Hello, retransmits, asks
heartbeats and counts their answers), the producer accepts (it challenges, checks a Hello
against its challenge, its address and the consumer's last incarnation, answers
heartbeats and counts silence). One parameterised machine would be two machines behind a
flag. Each is a :class:`~kvpush.protocol.table.Table`: per state, the events it accepts,
the handler and the states each may lead to, checked at dispatch.

* :class:`Dialer` -- the consumer's session with the producer at one address.
  :class:`Dialers` holds a consumer's dialers: a second address of a producer already
  dialled joins that session (one connection per producer, however its address is
  spelt), and a producer answering under a name already connected replaces that session
  (it restarted).
* :class:`Acceptor` -- a producer's sessions with its consumers, by connection identity:
  Probe -> Challenge, Hello -> HelloAck or HelloReject, a restarted consumer (its name with
  new NIXL metadata) replacing its old session, heartbeats answered, silence and Bye.

Frames go in as bytes and come out as bytes (:class:`Transmit`): the session authenticates
and seals them itself (:mod:`kvpush.auth`), so the simulator runs exactly the checks a real
endpoint runs, forged and replayed frames included. What a session needs done outside
it is an effect: :class:`Admit` (the driver hands the peer's NIXL metadata to its agent
and answers :meth:`Acceptor.admitted` / :meth:`Dialers.admitted` or refuses), and
:class:`PeerUp` / :class:`PeerDown` (the driver tells the role's request core). Frames for
the request core come back from ``receive`` as ``(agent name, message)``.

Clocks: every event takes ``now`` (monotonic seconds); the wall clock a Hello carries and
the producer checks comes from the ``wall`` callable given at construction, and nonces
from ``nonce`` (the simulator passes seeded ones).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from .. import messages as m
from .._enum import IdentityEnum
from ..auth import (
    HELLO_MAX_SKEW_S,
    Challenges,
    HelloGuard,
    Opener,
    Sealer,
    decrypt,
    encrypt,
    new_nonce,
    session_key,
)
from ..errors import (
    AuthenticationError,
    KvpushError,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
)
from ..layout import KVLayout, check_compatible
from .table import Table, row

__all__ = ["DIAL_TABLE", "LINK_TABLE", "AcceptConfig", "Accepted", "Acceptor", "Admit",
           "ConnectFailed", "DialConfig", "DialEvent", "DialState", "Dialer", "Dialers", "Link",
           "LinkEvent", "PeerDown", "PeerUp", "SessionEffect", "SessionStats", "Transmit"]

#: Connections a producer remembers after dropping them (their later frames are answered
#: under their session: a Bye or a Failed("not_connected") the consumer can trust).
DEPARTED = 4096
#: Consumer names whose last NIXL metadata digest a producer remembers.
INCARNATIONS = 4096


# -- effects -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Transmit:
    """Send ``frame`` (already encoded and sealed) on the session's connection: ``peer`` is
    the consumer's connection identity (producer) or the dialled address (consumer).
    ``best_effort``: an answer to a stranger, tried once, never queued."""

    peer: bytes | str
    frame: bytes
    best_effort: bool = False
    msg: m.Message | None = None      # what the frame holds (for tracing)
    again: bool = False               # a frame already sent, sent again (a retransmit's answer)


@dataclass(frozen=True, slots=True)
class Admit:
    """Hand ``metadata`` (the peer's NIXL agent metadata, opened) to the agent under
    ``name``, then answer ``admitted(now, peer, agent_name)`` or ``refuse(peer, error)``."""

    peer: bytes | str
    name: str
    metadata: bytes
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class PeerUp:
    """The session with ``name`` is up: the request core may use the peer."""

    name: str
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class PeerDown:
    """The request core ends what it had with ``name`` (``abandon``: its transfers are
    given up at once: a new incarnation's metadata is about to replace the old).
    ``rejoin`` (consumer): the producer asked to be dialled again."""

    name: str
    why: str
    abandon: bool = False
    rejoin: bool = False
    conn: bytes | str = b""     # the connection that ended (its identity, or address)


@dataclass(frozen=True, slots=True)
class ConnectFailed:
    """Consumer: dialling ``address`` failed for good (its waiters get ``error``).
    ``timed_out``: its deadline passed with no answer it could take (else the producer
    refused it, or the session was ended)."""

    address: str
    error: KvpushError
    timed_out: bool = False


def _tx(peer: bytes | str, msg: m.Message, sealer: Sealer | None = None,
        best_effort: bool = False) -> Transmit:
    return Transmit(peer, m.encode(msg, sealer), best_effort, msg)


SessionEffect = Union[Transmit, Admit, PeerUp, PeerDown, ConnectFailed]  # noqa: UP007


# -- the consumer's side: one dialled producer ------------------------------------------
class DialState(IdentityEnum):
    PROBING = "probing"        # Probe sent (re-sent) until a Challenge answers
    HELLO = "hello"            # Hello sent (re-sent) until a HelloAck or HelloReject
    ADMITTING = "admitting"    # HelloAck taken; the agent is given the producer's metadata
    UP = "up"                  # connected: heartbeats asked, frames go to the core
    DOWN = "down"              # lost, failed, joined to a twin, or closed: nothing more


class DialEvent(IdentityEnum):
    RETRY = "retry"
    CHALLENGE = "challenge"
    TWIN = "twin"
    ACK = "ack"
    REJECT = "reject"
    ADMITTED = "admitted"
    REFUSED = "refused"
    HEARTBEAT = "heartbeat"
    HEARTBEAT_ACK = "heartbeat_ack"
    BYE = "bye"
    LOSE = "lose"


_D = DialState
_DE = DialEvent
DIAL_TABLE: Table[DialState, DialEvent] = Table("Dialer", {
    _D.PROBING: {
        _DE.RETRY: row("_retry", _D.PROBING, _D.HELLO, _D.DOWN),
        _DE.CHALLENGE: row("_on_challenge", _D.HELLO),
        _DE.TWIN: row("_on_twin", _D.DOWN),
        _DE.REJECT: row("_on_reject", _D.PROBING, _D.DOWN),
        _DE.LOSE: row("_down", _D.DOWN),
    },
    _D.HELLO: {
        _DE.RETRY: row("_retry", _D.PROBING, _D.HELLO, _D.DOWN),
        _DE.ACK: row("_on_ack", _D.ADMITTING, _D.DOWN),
        _DE.REJECT: row("_on_reject", _D.PROBING, _D.DOWN),
        _DE.LOSE: row("_down", _D.DOWN),
    },
    _D.ADMITTING: {
        _DE.ADMITTED: row("_on_admitted", _D.UP),
        _DE.REFUSED: row("_down", _D.DOWN),
        _DE.LOSE: row("_down", _D.DOWN),
    },
    _D.UP: {
        _DE.ACK: row(None, _D.UP),               # an answer to a re-sent Hello
        _DE.REJECT: row(None, _D.UP),
        _DE.HEARTBEAT: row("_on_heartbeat", _D.UP, _D.DOWN),
        _DE.HEARTBEAT_ACK: row("_on_heartbeat_ack", _D.UP),
        _DE.BYE: row("_down", _D.DOWN),
        _DE.LOSE: row("_down", _D.DOWN),
    },
    _D.DOWN: {},
}, initial=(_D.PROBING,), final=(_D.DOWN,))


@dataclass
class DialConfig:
    """What every dialer of one consumer shares."""

    me: str                     # this consumer's NIXL agent name
    layout: KVLayout            # this side's layout (checked against the producer's)
    key: bytes | None
    peer_timeout_s: float
    retry_s: float = 0.05       # first retransmit delay (doubling)
    retry_max_s: float = 2.0
    wall: Callable[[], float] = time.time
    nonce: Callable[[], bytes] = new_nonce
    # the layout the Hello carries: the agent's (a data-plane child registers the memory
    # itself, with its own addresses); default ``layout``
    wire: Callable[[], KVLayout] | None = None
    heartbeat_s: float = 0.0    # told to the producer in the Hello, with peer_timeout_s


class Dialer:
    """The consumer's session with the producer at ``address`` (see the module doc)."""

    def __init__(self, cfg: DialConfig, address: str,
                 metadata: bytes | Callable[[], bytes], now: float,
                 deadline: float) -> None:
        self.cfg = cfg
        self.address = address
        # this side's NIXL metadata, sent in the Hello (a callable: read when the Hello is
        # made, so a data plane restarted meanwhile sends its new metadata)
        self.metadata = metadata
        self.deadline = deadline          # of the handshake (math.inf: dial until answered)
        self.state = DialState.PROBING
        self.name = ""                    # the producer's, once it answered a Probe
        self.instance = b""
        self.layout: KVLayout | None = None
        self.why = ""                     # why it went down
        self.error: KvpushError | None = None
        self.timed_out = False            # the handshake's deadline passed
        # With a key, a refusal that is not sealed cannot end the handshake (anyone can send
        # one): its reason is kept for the error if the handshake times out (a producer
        # without our key can only answer that way).
        self.refusal = ""
        # One attempt: a nonce (the Probe's and the Hello's), the producer's Challenge, and
        # the Hello; every retransmit is the same frame (a producer answers retransmits of
        # one Hello with one session).
        self.nonce = b""
        self.made = 0.0
        self.challenge: m.Challenge | None = None
        self.hello: m.Hello | None = None
        self.delay = cfg.retry_s
        self.retry_at = now
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self.notif_sealer: Sealer | None = None
        self.notif_opener: Opener | None = None
        self.hb_seq = 0
        # (seq, when sent) of the oldest Heartbeat not answered: silence counts from a
        # question this side asked, never across a stall of its own loop.
        self.unanswered: tuple[int, float] | None = None
        # the time of the producer's latest frame in this session: a loss by silence says
        # how long ago it came, telling answers that stopped from a producer gone quiet
        self.heard = now
        self._out: list[SessionEffect] = []
        self._now = now

    # -- dispatch ----------------------------------------------------------------------
    def _run(self, event: DialEvent, now: float, *args: object) -> list[SessionEffect]:
        self._now = now
        DIAL_TABLE.run(self, event, lambda: self.state, *args)
        out, self._out = self._out, []
        return out

    @property
    def up(self) -> bool:
        return self.state is DialState.UP

    def next_deadline(self) -> float | None:
        """When :meth:`tick` has something to do (a retransmit, the handshake's deadline)."""
        if self.state in (DialState.PROBING, DialState.HELLO):
            return min(self.retry_at, self.deadline)
        return None

    def tick(self, now: float) -> list[SessionEffect]:
        if self.state not in (DialState.PROBING, DialState.HELLO) \
                or now < min(self.retry_at, self.deadline):
            return []
        return self._run(DialEvent.RETRY, now)

    def receive(self, now: float, frame: bytes | memoryview
                ) -> tuple[list[SessionEffect], m.Message | None]:
        """A frame from the producer. Returns the effects and, once connected, a message
        for the request core (None otherwise). Raises AuthenticationError or
        ProtocolError for a frame refused (the caller counts it)."""
        msg = self._decode(frame)
        if isinstance(msg, m.Challenge):
            if msg.echo != self.nonce or self.state is not DialState.PROBING:
                return [], None       # an answer to a re-sent Probe, or an earlier attempt
            return self._run(DialEvent.CHALLENGE, now, msg), None
        if isinstance(msg, m.HelloAck):
            if DIAL_TABLE.row(self.state, DialEvent.ACK) is None:
                raise ProtocolError("HelloAck before this attempt's Hello")
            return self._run(DialEvent.ACK, now, msg), None
        if isinstance(msg, m.HelloReject):
            return self._run(DialEvent.REJECT, now, msg), None
        if self.state is not DialState.UP:
            raise ProtocolError(f"{type(msg).__name__} before the handshake")
        self.heard = now
        if isinstance(msg, m.HeartbeatAck):
            return self._run(DialEvent.HEARTBEAT_ACK, now, msg), None
        if isinstance(msg, m.Bye):
            why = ("producer asked to be dialled again (its data plane restarted, or it was "
                   "silent long enough that this side may have given it up)") if msg.rejoin \
                else "producer closed"
            return self._run(DialEvent.BYE, now, why, False, msg.rejoin), None
        return [], msg

    def joined(self, now: float) -> list[SessionEffect]:
        """This address reaches a producer dialled under another address: this session
        ends (its waiters go to the twin's)."""
        return self._run(DialEvent.TWIN, now)

    def admitted(self, now: float) -> list[SessionEffect]:
        return self._run(DialEvent.ADMITTED, now)

    def refused(self, now: float, error: KvpushError) -> list[SessionEffect]:
        self.error = error
        return self._run(DialEvent.REFUSED, now, str(error))

    def heartbeat(self, now: float) -> list[SessionEffect]:
        """Ask whether the producer is there, or lose it if the oldest question is
        unanswered ``peer_timeout_s`` after it was asked."""
        return self._run(DialEvent.HEARTBEAT, now)

    def lose(self, now: float, why: str) -> list[SessionEffect]:
        return self._run(DialEvent.LOSE, now, why)

    def seal(self, msg: m.Message) -> bytes:
        return m.encode(msg, self.sealer)

    # -- handlers ----------------------------------------------------------------------
    def _send(self, msg: m.Message, sealer: Sealer | None) -> None:
        self._out.append(_tx(self.address, msg, sealer))

    def _retry(self) -> None:
        now = self._now
        if now >= self.deadline:
            self.timed_out = True
            self.error = AuthenticationError(
                f"{self.address} did not answer the handshake with our key; an answer "
                f"that could not be authenticated said: {self.refusal}") if self.refusal \
                else PeerUnavailable(f"no answer from {self.address}")
            self._down(str(self.error))
            return
        # One attempt, re-sent as is; renewed only before the producer would find it stale,
        # or when the producer no longer knows its challenge.
        if not self.nonce or now - self.made > HELLO_MAX_SKEW_S / 2:
            self.made, self.nonce = now, self.cfg.nonce()
            self.challenge = self.hello = None
            self.state = DialState.PROBING
        key = self.cfg.key
        hs = None if key is None else Sealer(key, b"hello")   # counter 1: the same frame
        if self.challenge is None:
            self._send(m.Probe(self.nonce), hs)
        else:
            if self.hello is None:
                metadata = self.metadata() if callable(self.metadata) else self.metadata
                if key is not None:   # this side's memory keys travel encrypted
                    metadata = encrypt(key, b"hello-metadata",
                                       self.nonce + self.cfg.me.encode(), metadata)
                wire = self.cfg.wire() if self.cfg.wire else self.cfg.layout
                self.hello = m.Hello(self.cfg.me, metadata, wire.to_wire(),
                                     self.nonce, self.cfg.wall(), self.address,
                                     self.challenge.nonce, self.cfg.heartbeat_s,
                                     self.cfg.peer_timeout_s)
            self._send(self.hello, hs)
        self.retry_at = min(self.deadline, now + self.delay)
        self.delay = min(self.delay * 2, self.cfg.retry_max_s)

    def _on_challenge(self, msg: m.Challenge) -> None:
        # the Hello goes on the next tick, once the caller knows this is no second address
        # of a producer it dials already (Dialers)
        self.challenge = msg
        self.name, self.instance = msg.name, msg.instance
        self.state = DialState.HELLO
        self.delay = self.cfg.retry_s
        self.retry_at = self._now

    def _on_twin(self) -> None:
        self.state = DialState.DOWN
        self.why = "joined"

    def _on_ack(self, msg: m.HelloAck) -> None:
        if self.challenge is None or msg.name != self.challenge.name:
            raise ProtocolError("HelloAck not the answer to our Hello")
        try:
            remote = KVLayout.from_wire(msg.layout)
            check_compatible(self.cfg.layout, remote)
            metadata = msg.agent_metadata
            if self.cfg.key is not None:
                session = session_key(self.cfg.key, msg.echo, msg.nonce)
                metadata = decrypt(session, b"ack-metadata", msg.nonce + msg.echo, metadata)
                self.sealer, self.opener = Sealer(session, b"c2p"), Opener(session, b"p2c")
                self.notif_sealer = Sealer(session, b"c2p-notif")
                # A Landed counts once per (xid, part) while its request lives, so old
                # notification counters are accepted (forgeries and repeats inside the
                # window are not): a big WRITE's Landed can be overtaken by thousands.
                self.notif_opener = Opener(session, b"p2c-notif", accept_old=True)
        except KvpushError as exc:
            self.error = exc
            self._down(str(exc))
            return
        self.layout = remote
        self.state = DialState.ADMITTING
        self._out.append(Admit(self.address, msg.name, metadata, remote))

    def _on_admitted(self) -> None:
        self.state = DialState.UP
        self.heard = self._now
        assert self.layout is not None
        self._out.append(PeerUp(self.name, self.layout))
        # The producer counts a new session's silence from the HelloAck it sent, which a
        # congested link can hold for most of peer_timeout_s: the first Heartbeat goes as
        # the session comes up, not a heartbeat period later.
        self._on_heartbeat()

    def _on_reject(self, msg: m.HelloReject) -> None:
        if msg.field == "challenge":      # it no longer knows ours: probe again
            self.nonce = b""
            self.state = DialState.PROBING
            return
        error: KvpushError
        if msg.field == "auth_key":
            error = AuthenticationError(f"{self.address} refused the handshake: {msg.reason}")
        elif msg.field:
            error = LayoutMismatch(msg.field, msg.local, msg.remote)
        else:
            error = PeerUnavailable(msg.reason)
        self.error = error
        self._down(str(error))

    def _on_heartbeat(self) -> None:
        now = self._now
        asked = self.unanswered
        if asked is not None and now - asked[1] > self.cfg.peer_timeout_s:
            self._down(f"no answer for {self.cfg.peer_timeout_s} s ({self.hb_seq - asked[0] + 1} "
                       f"heartbeats unanswered; last frame from it {now - self.heard:.2f} s "
                       f"ago)")
            return
        self.hb_seq += 1
        if asked is None:
            self.unanswered = (self.hb_seq, now)
        self._out.append(_tx(self.address, m.Heartbeat(self.hb_seq, now), self.sealer))

    def _on_heartbeat_ack(self, msg: m.HeartbeatAck) -> None:
        if self.unanswered is not None and msg.seq >= self.unanswered[0]:
            self.unanswered = None

    def _down(self, why: str, abandon: bool = False, rejoin: bool = False) -> None:
        was = self.state
        self.state = DialState.DOWN
        self.why = why
        if was is DialState.UP:
            self._out.append(PeerDown(self.name, why, abandon, rejoin, self.address))
        elif self.error is None and was is not DialState.ADMITTING:
            self.error = PeerUnavailable(why)
        if was is not DialState.UP:
            self._out.append(ConnectFailed(self.address, self.error or PeerUnavailable(why),
                                           self.timed_out))

    # -- frames ------------------------------------------------------------------------
    def _decode(self, frame: bytes | memoryview) -> m.Message:
        key = self.cfg.key
        if key is None:
            return m.decode(frame)
        if self.opener is not None:
            try:
                return m.decode(frame, self.opener)
            except AuthenticationError as exc:
                if not m.is_sealed(frame):
                    raise
                # the answer to a re-sent Probe or Hello, sealed with the key: not an
                # attack; any other frame the session refuses keeps the session's reason
                # (a replayed frame is no "handshake answer")
                try:
                    return self._handshake_answer(frame)
                except AuthenticationError:
                    raise exc from None
        # Handshake with a key: only a sealed answer echoing this attempt's nonce counts. A
        # plain HelloReject (a producer without our key can only say no, and so can anyone)
        # is kept as the likely reason should the handshake time out.
        if not m.is_sealed(frame):
            msg = m.decode(frame)
            if isinstance(msg, m.HelloReject):
                self.refusal = msg.reason
            raise AuthenticationError(f"unauthenticated {type(msg).__name__}")
        return self._handshake_answer(frame)

    def _handshake_answer(self, frame: bytes | memoryview) -> m.Message:
        assert self.cfg.key is not None
        for label, kinds in ((b"hello-ack", (m.HelloAck, m.HelloReject)),
                             (b"challenge", (m.Challenge,))):
            try:
                msg = m.decode(frame, Opener(self.cfg.key, label, replay=False))
            except AuthenticationError:
                continue
            if isinstance(msg, kinds) and self.nonce and msg.echo == self.nonce:
                return msg
            break
        raise AuthenticationError("handshake answer does not match our Hello")


class Dialers:
    """A consumer's sessions, by every address dialled (two addresses of one producer map
    to one session) and, once connected, by producer name."""

    def __init__(self, cfg: DialConfig) -> None:
        self.cfg = cfg
        self.by_address: dict[str, Dialer] = {}
        self.by_name: dict[str, Dialer] = {}

    def dial(self, now: float, address: str, metadata: bytes | Callable[[], bytes],
             deadline: float) -> tuple[Dialer, list[SessionEffect]]:
        """The session for ``address``: the existing one, or a new one (its Probe sent)."""
        d = self.by_address.get(address)
        if d is not None:
            return d, []
        d = Dialer(self.cfg, address, metadata, now, deadline)
        self.by_address[address] = d
        return d, d._run(DialEvent.RETRY, now)

    def __iter__(self) -> Iterator[Dialer]:
        return iter(list(dict.fromkeys(self.by_address.values())))

    def tick(self, now: float) -> list[SessionEffect]:
        out: list[SessionEffect] = []
        for d in self:
            out += self._settle(d, d.tick(now))
        return out

    def next_deadline(self) -> float | None:
        due = [t for d in self if (t := d.next_deadline()) is not None]
        return min(due) if due else None

    def receive(self, now: float, d: Dialer, frame: bytes | memoryview
                ) -> tuple[list[SessionEffect], m.Message | None]:
        if self.by_address.get(d.address) is not d:
            return [], None
        was = d.state
        out, msg = d.receive(now, frame)
        if was is DialState.PROBING and d.state is DialState.HELLO:
            twin = self._twin(d)
            if twin is not None:
                # this address reaches a producer dialled under another: one connection
                out = d.joined(now)
                for a in [a for a, x in self.by_address.items() if x is d]:
                    self.by_address[a] = twin
                return out, None
            out += d.tick(now)        # the Hello
        if d.state is DialState.ADMITTING and was is not DialState.ADMITTING:
            old = self.by_name.get(d.name)
            if old is not None and old is not d:
                # the same producer, restarted under another address before we noticed:
                # its old session's state goes before the agent takes the new metadata
                out = [*old.lose(now, f"restarted at {d.address}"), *out]
                out = self._settle(old, out)
        return self._settle(d, out), msg

    def _twin(self, d: Dialer) -> Dialer | None:
        for other in self:
            if other is not d and other.state is not DialState.DOWN \
                    and other.name == d.name and other.instance == d.instance \
                    and other.state is not DialState.PROBING:
                return other
        return None

    def admitted(self, now: float, d: Dialer) -> list[SessionEffect]:
        out = d.admitted(now)
        self.by_name[d.name] = d
        return out

    def refused(self, now: float, d: Dialer, error: KvpushError) -> list[SessionEffect]:
        return self._settle(d, d.refused(now, error))

    def heartbeat(self, now: float) -> list[SessionEffect]:
        out: list[SessionEffect] = []
        for d in list(self.by_name.values()):
            out += self._settle(d, d.heartbeat(now))
        return out

    def lose(self, now: float, d: Dialer, why: str) -> list[SessionEffect]:
        return self._settle(d, d.lose(now, why))

    def _settle(self, d: Dialer, out: list[SessionEffect]) -> list[SessionEffect]:
        """A session that went down is forgotten under every address and its name."""
        if d.state is DialState.DOWN and d.why != "joined":
            for a in [a for a, x in self.by_address.items() if x is d]:
                del self.by_address[a]
            if self.by_name.get(d.name) is d:
                del self.by_name[d.name]
        return out


# -- the producer's side: its consumers ----------------------------------------------------
class Link(IdentityEnum):
    ADMITTING = "admitting"    # Hello checked; the agent is given the consumer's metadata
    UP = "up"                  # connected: frames go to the core, heartbeats answered
    DEPARTED = "departed"      # dropped: its later frames are answered under its session


class LinkEvent(IdentityEnum):
    ADMITTED = "admitted"
    REFUSED = "refused"
    HEARTBEAT = "heartbeat"
    BYE = "bye"
    SILENT = "silent"
    DROP = "drop"


_L = Link
_LE = LinkEvent
LINK_TABLE: Table[Link, LinkEvent] = Table("Accepted", {
    _L.ADMITTING: {
        _LE.ADMITTED: row("_on_admitted", _L.UP),
        _LE.REFUSED: row("_on_refused", _L.DEPARTED),
        _LE.DROP: row("_on_drop", _L.DEPARTED),
    },
    _L.UP: {
        _LE.HEARTBEAT: row("_on_heartbeat", _L.UP),
        _LE.BYE: row("_on_drop", _L.DEPARTED),
        _LE.SILENT: row("_on_drop", _L.DEPARTED),
        _LE.DROP: row("_on_drop", _L.DEPARTED),
    },
    _L.DEPARTED: {},
}, initial=(_L.ADMITTING,), final=(_L.DEPARTED,))


#: How fast the offset between a consumer's clock and this side's may grow, in seconds per
#: second (clocks of two hosts run at rates a few parts per million apart).
CLOCK_CREEP = 1e-3


def _delay(peer: Accepted, now: float, sent: float) -> float:
    """How much longer than the quickest of ``peer``'s frames one it sent at ``sent`` (its
    monotonic clock) took to be read here at ``now``. The offset between the clocks is the
    least (read here - sent there) seen so far, let grow by :data:`CLOCK_CREEP` so that
    clocks running at slightly different rates stay matched."""
    seen = now - sent
    offset = min(seen, peer.offset + CLOCK_CREEP * (now - peer.offset_at))
    peer.offset, peer.offset_at = offset, now
    return seen - offset


@dataclass
class Accepted:
    """A producer's session with one consumer connection."""

    identity: bytes
    name: str                    # the consumer's NIXL agent name
    layout: KVLayout
    last_seen: float
    state: Link = Link.ADMITTING
    sealer: Sealer | None = None
    opener: Opener | None = None
    notif_sealer: Sealer | None = None
    notif_opener: Opener | None = None
    # the Hello this connection answered and the answer, re-sent as is to a retransmit
    hello_nonce: bytes = b""
    hello_metadata: bytes = b""     # as it came (a retransmit without a key is the same)
    digest: bytes = b""             # of the opened NIXL metadata: the incarnation
    ack_frame: bytes = b""
    rejoin: bool = False         # dropped by a data-plane restart: told to connect again
    # How the consumer judges this producer's silence (its Hello; 0: not said, not judged)
    heartbeat_s: float = 0.0
    peer_timeout_s: float = 0.0
    # The clocks' offset as its frames show it (see :func:`_delay`), and since when the
    # consumer may have given this producer up if no later Heartbeat of it is read in time
    offset: float = math.inf
    offset_at: float = 0.0
    trusted_until: float = math.inf
    out: list[SessionEffect] = field(default_factory=list)
    # set by the handler of the event being run
    why: str = ""
    abandon: bool = False

    def _on_admitted(self) -> None:
        self.state = Link.UP

    def _on_refused(self) -> None:
        self.state = Link.DEPARTED

    def _on_heartbeat(self, seq: int) -> None:
        self.out.append(_tx(self.identity, m.HeartbeatAck(seq), self.sealer))

    def _on_drop(self) -> None:
        self.state = Link.DEPARTED
        self.ack_frame = self.hello_metadata = b""   # its session is all that is kept
        self.out.append(PeerDown(self.name, self.why, self.abandon, conn=self.identity))


class _Refused(AuthenticationError):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field, self.reason = field, reason


@dataclass
class SessionStats:
    """What an :class:`Acceptor` counts, when its driver keeps no such counters."""

    auth_rejected: int = 0
    messages_rejected: int = 0
    peers_lost: int = 0


@dataclass
class AcceptConfig:
    me: str                        # the producer's NIXL agent name
    layout: KVLayout
    key: bytes | None
    peer_timeout_s: float
    address: str = ""              # advertised (a Hello must have dialled it, or bound)
    bound: str = ""
    wall: Callable[[], float] = time.time
    nonce: Callable[[], bytes] = new_nonce
    # the layout the HelloAck carries: the agent's (a data-plane child registers the
    # memory itself, with its own addresses); default ``layout``
    wire: Callable[[], KVLayout] | None = None


class Acceptor:
    """A producer's sessions with its consumers (see the module doc)."""

    def __init__(self, cfg: AcceptConfig, metadata: Callable[[], bytes],
                 stats: Any = None) -> None:
        self.cfg = cfg
        self._metadata = metadata
        self.consumers: dict[bytes, Accepted] = {}       # connected (or being admitted)
        self.by_agent: dict[str, Accepted] = {}           # by name, until the core's DropPeer
        self.departed: dict[bytes, Accepted] = {}
        # what this producer answers a Probe with: a consumer reaching it under two
        # addresses knows it is one producer
        self.instance = cfg.nonce()
        self.challenges = Challenges()
        self.guard = HelloGuard()
        # each consumer name's last NIXL metadata digest: a Hello under a known name with
        # other metadata is a new incarnation, even once the old one was forgotten
        self.incarnations: dict[str, bytes] = {}
        self.stats: Any = stats if stats is not None else SessionStats()

    # -- dispatch ----------------------------------------------------------------------
    def _run(self, peer: Accepted, event: LinkEvent, *args: object) -> list[SessionEffect]:
        LINK_TABLE.run(peer, event, lambda: peer.state, *args)
        out, peer.out = peer.out, []
        if peer.state is Link.DEPARTED and self.consumers.get(peer.identity) is peer:
            del self.consumers[peer.identity]
            while len(self.departed) >= DEPARTED:
                del self.departed[next(iter(self.departed))]
            self.departed[peer.identity] = peer
        return out

    def connected(self, name: str) -> Accepted | None:
        """The session of consumer ``name`` if it is connected (up)."""
        peer = self.by_agent.get(name)
        if peer is None or peer.state is not Link.UP \
                or self.consumers.get(peer.identity) is not peer:
            return None
        return peer

    def connected_at(self, identity: bytes) -> Accepted | None:
        """The session on connection ``identity`` if it is up."""
        peer = self.consumers.get(identity)
        return peer if peer is not None and peer.state is Link.UP else None

    def seal(self, name: str, msg: m.Message) -> Transmit | None:
        """A frame for connected consumer ``name`` (None: not connected)."""
        peer = self.connected(name)
        if peer is None:
            return None
        return _tx(peer.identity, msg, peer.sealer)

    def forget(self, name: str) -> bool:
        """The core is done with ``name`` (its DropPeer): True when the agent drops its
        NIXL state too (no newer connection of that name uses it)."""
        peer = self.by_agent.get(name)
        live = peer is not None and self.consumers.get(peer.identity) is peer
        if peer is not None and not live:
            del self.by_agent[name]
        return not live

    def _read_late(self, peer: Accepted, now: float, msg: m.Heartbeat | m.Register) -> str:
        """Why ``peer`` may have given this producer up, judged by a frame read now (""
        if it cannot have). The consumer gives a producer up once one of its Heartbeats
        goes unanswered ``peer_timeout_s``; a frame of it read that much later than its
        quickest ones waited in this side's socket (a stalled loop, a frozen process) or
        on the way (a cut), and so did the Heartbeats sent beside it. Serving it then --
        a Register's WRITE -- could write blocks the consumer has failed and reused. One
        heartbeat period of the timeout is kept for the answer's way back."""
        delay = _delay(peer, now, msg.sent)
        if delay > peer.peer_timeout_s - peer.heartbeat_s:
            return (f"read its {type(msg).__name__} {delay:.2f} s late: it gives a producer "
                    f"up after {peer.peer_timeout_s} s without an answer, and may have")
        if isinstance(msg, m.Heartbeat):
            # answered in time; its next one is due heartbeat_s after it, and must be
            # answered within the same bound
            peer.trusted_until = msg.sent + peer.offset + peer.peer_timeout_s
        return ""

    def doubt(self, name: str, now: float) -> str:
        """Why connected consumer ``name`` may have given this producer up by ``now`` (""
        if it cannot have): no Heartbeat of it read in time since the last one answered,
        whose successor is due (this loop may not have read it yet). A WRITE to it now
        could land in blocks it has failed and reused."""
        peer = self.connected(name)
        if peer is None or now <= peer.trusted_until:
            return ""
        return (f"no Heartbeat of it read for {now - peer.trusted_until + peer.peer_timeout_s:.2f}"
                f" s: it gives a producer up after {peer.peer_timeout_s} s without an "
                f"answer, and may have")

    def check(self, now: float) -> list[SessionEffect]:
        """Drop every consumer silent for ``peer_timeout_s`` (the caller reads what
        waits in its sockets first)."""
        out: list[SessionEffect] = []
        for peer in list(self.consumers.values()):
            if peer.state is Link.UP and now - peer.last_seen > self.cfg.peer_timeout_s:
                out += self.drop(peer, f"no heartbeat for {self.cfg.peer_timeout_s} s")
        return out

    def drop(self, peer: Accepted, why: str, *, abandon: bool = False,
             rejoin: bool = False) -> list[SessionEffect]:
        """End ``peer``'s session (``rejoin``: it is told, now and on its next heartbeat,
        to connect again)."""
        if self.consumers.get(peer.identity) is not peer:
            return []
        out: list[SessionEffect] = []
        if rejoin and peer.state is Link.UP:
            out.append(_tx(peer.identity, m.Bye(self.cfg.me, rejoin=True), peer.sealer))
            peer.rejoin = True
        if peer.state is Link.UP:
            self.stats.peers_lost += 1
        peer.why, peer.abandon = why, abandon
        return out + self._run(peer, LinkEvent.DROP)

    def close(self) -> list[Transmit]:
        """Bye to every connected consumer."""
        return [_tx(p.identity, m.Bye(self.cfg.me), p.sealer)
                for p in self.consumers.values() if p.state is Link.UP]

    def admitted(self, now: float, identity: bytes, agent_name: str) -> list[SessionEffect]:
        """The agent took the consumer's metadata under ``agent_name``: the HelloAck."""
        peer = self.consumers.get(identity)
        if peer is None or peer.state is not Link.ADMITTING:
            return []
        if agent_name != peer.name:   # the Hello is bound to the sender's NIXL agent
            return self.refuse(identity, m.HelloReject(
                f"Hello from {peer.name!r} carries the NIXL metadata of {agent_name!r}"))
        if peer.name not in self.incarnations and len(self.incarnations) >= INCARNATIONS:
            del self.incarnations[next(iter(self.incarnations))]
        self.incarnations[peer.name] = peer.digest
        key = self.cfg.key
        wire = (self.cfg.wire() if self.cfg.wire else self.cfg.layout).to_wire()
        ack = m.HelloAck(self.cfg.me, self._metadata(), wire)
        ack_sealer = None
        if key is not None:
            nonce = self.cfg.nonce()
            session = session_key(key, peer.hello_nonce, nonce)
            peer.sealer, peer.opener = Sealer(session, b"p2c"), Opener(session, b"c2p")
            peer.notif_sealer = Sealer(session, b"p2c-notif")
            # a PullDone counts once per owner while its source lives: old notification
            # counters are accepted (as the consumer's Landed are)
            peer.notif_opener = Opener(session, b"c2p-notif", accept_old=True)
            ack = m.HelloAck(self.cfg.me, encrypt(session, b"ack-metadata",
                                                  nonce + peer.hello_nonce, self._metadata()),
                             wire, nonce=nonce, echo=peer.hello_nonce)
            ack_sealer = Sealer(key, b"hello-ack")
        peer.ack_frame = m.encode(ack, ack_sealer)
        self.by_agent[agent_name] = peer
        out = self._run(peer, LinkEvent.ADMITTED)
        return [*out, PeerUp(agent_name, peer.layout),
                Transmit(identity, peer.ack_frame, msg=ack)]

    def refuse(self, identity: bytes, reject: m.HelloReject,
               hello_nonce: bytes | None = None) -> list[SessionEffect]:
        """Refuse the Hello of ``identity``, once. With a key the refusal is sealed with it
        and echoes the Hello's nonce, so its consumer can tell it from a stranger's."""
        peer = self.consumers.get(identity)
        if peer is not None and peer.state is Link.ADMITTING:
            hello_nonce = peer.hello_nonce
            self._run(peer, LinkEvent.REFUSED)     # never up: not kept as departed
            self.consumers.pop(identity, None)
            self.departed.pop(identity, None)
        sealer = None
        if self.cfg.key is not None:
            reject = msgspec.structs.replace(reject, echo=hello_nonce or b"")
            sealer = Sealer(self.cfg.key, b"hello-ack")
        return [_tx(identity, reject, sealer, best_effort=True)]

    # -- frames ------------------------------------------------------------------------
    def receive(self, now: float, identity: bytes, frame: bytes | memoryview
                ) -> tuple[list[SessionEffect], tuple[str, m.Message] | None]:
        """A frame from connection ``identity``: the effects, and a message for the core
        (with the consumer's name) if it is one."""
        peer = self.consumers.get(identity)
        if peer is not None and peer.state is not Link.UP:
            peer = None if peer.state is Link.DEPARTED else peer
        departed = self.departed.get(identity) if peer is None else None
        try:
            msg = self._decode(peer or departed, frame, now)
        except AuthenticationError as exc:
            self.stats.auth_rejected += 1
            if peer is None:   # tell a would-be peer why its handshake fails
                return [_tx(identity, m.HelloReject(str(exc), "auth_key"),
                            best_effort=True)], None
            return [], None
        except ProtocolError:
            self.stats.messages_rejected += 1
            return [], None
        if peer is not None:
            peer.last_seen = now
        if isinstance(msg, m.Probe):
            challenge = m.Challenge(self.cfg.me, self.instance,
                                    self.challenges.issue(now, self.cfg.nonce()), msg.nonce)
            sealer = None if self.cfg.key is None else Sealer(self.cfg.key, b"challenge")
            return [_tx(identity, challenge, sealer, best_effort=True)], None
        if isinstance(msg, m.Hello):
            return self._on_hello(now, identity, msg), None
        if peer is None or peer.state is not Link.UP:
            # not connected (dropped, or never): it should know, under its session if it
            # had one (a refusal it could not authenticate would be discarded)
            self.stats.messages_rejected += 1
            sealer = departed.sealer if departed is not None else None
            if isinstance(msg, (m.Register, m.PullBegin, m.Claim)):
                return [_tx(identity, m.Failed(msg.request_id, msg.xid, "not_connected",
                                               "no handshake from this consumer"),
                            sealer, best_effort=True)], None
            if isinstance(msg, m.Heartbeat):
                rejoin = departed is not None and departed.rejoin
                return [_tx(identity, m.Bye(self.cfg.me, rejoin=rejoin), sealer,
                            best_effort=True)], None
            return [], None
        if isinstance(msg, (m.Heartbeat, m.Register)) and peer.peer_timeout_s \
                and msg.sent and math.isfinite(msg.sent):
            late = self._read_late(peer, now, msg)
            if late:
                return self.drop(peer, late, rejoin=True), None
        if isinstance(msg, m.Heartbeat):
            return self._run(peer, LinkEvent.HEARTBEAT, msg.seq), (peer.name, msg)
        if isinstance(msg, m.Bye):
            peer.why, peer.abandon = "consumer closed", False
            self.stats.peers_lost += 1
            return self._run(peer, LinkEvent.BYE), None
        return [], (peer.name, msg)

    def _decode(self, peer: Accepted | None, frame: bytes | memoryview, now: float
                ) -> m.Message:
        key = self.cfg.key
        if key is None:
            return m.decode(frame)
        if peer is not None and peer.opener is not None and m.is_sealed(frame):
            try:
                return m.decode(frame, peer.opener)
            except AuthenticationError:
                pass   # maybe a Hello from the same peer, restarted: sealed with the key
        msg = m.decode(frame, Opener(key, b"hello", replay=False))
        if isinstance(msg, m.Probe):
            return msg
        if not isinstance(msg, m.Hello):
            raise AuthenticationError(f"{type(msg).__name__} sealed with the handshake key")
        return msg   # its nonce and time are checked by check_hello (answered, sealed)

    def addressed_here(self, to: str) -> bool:
        """Whether a Hello dialled this producer: its address, the bound one, or -- bound
        to a wildcard host, or dialled by a host name -- its port."""
        address, bound = self.cfg.address, self.cfg.bound
        if to in (address, bound):
            return True
        host, _, port = to.removeprefix("tcp://").rpartition(":")
        bound_host = bound.removeprefix("tcp://").rpartition(":")[0]
        if port != bound.rpartition(":")[2]:
            return False
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return True   # a host name: not resolved here
        return bound_host in ("0.0.0.0", "*", "[::]")

    def check_hello(self, now: float, msg: m.Hello) -> tuple[bytes, str]:
        """The Hello's NIXL metadata, opened, or ``(b"", field)``: the HelloReject field of
        why it is refused -- "challenge" when it does not answer a challenge this producer
        issued (meant for another, replayed, or stale: the consumer probes again),
        "auth_key" when it was meant for another address or does not open with the key.
        AuthenticationError carries the reason (see :meth:`_on_hello`)."""
        key = self.cfg.key
        if key is None:
            # No key, so nothing to authenticate; but the challenge still says which
            # instance the Hello was made for. A Hello made for this producer's previous
            # instance (held in a socket while it restarted) is refused, so the consumer
            # probes again and learns that it reaches a new instance: taken as it was, it
            # left the consumer with a session on the new instance that it believed on the
            # old one, and a second spelling of the address, probed meanwhile, looked like
            # another producer, said Hello too, and ended the first session.
            try:
                self.challenges.redeem(msg.challenge, now)
            except AuthenticationError as exc:
                raise _Refused("challenge", str(exc)) from None
            return msg.agent_metadata, ""
        try:
            self.guard.check(msg.nonce, msg.sent_at, self.cfg.wall())
        except AuthenticationError as exc:
            # A nonce seen already: an attacker's replay, or the consumer's own retransmit
            # of a Hello this side refused or dropped since (a producer restarted during
            # the handshake gets both copies). Either way the attempt is spent: the
            # consumer is told to start a new one, as for a challenge this side no longer
            # knows (a refusal that ended its connect() would fail a healthy consumer).
            raise _Refused("challenge" if "replayed" in str(exc) else "auth_key",
                           str(exc)) from None
        if not self.addressed_here(msg.to):
            raise _Refused("auth_key", f"Hello meant for {msg.to!r}, not this producer "
                                       f"({self.cfg.address})")
        try:
            self.challenges.redeem(msg.challenge, now)
        except AuthenticationError as exc:
            raise _Refused("challenge", str(exc)) from None
        try:
            return decrypt(key, b"hello-metadata", msg.nonce + msg.name.encode(),
                           msg.agent_metadata), ""
        except AuthenticationError as exc:
            raise _Refused("auth_key", str(exc)) from None

    def _on_hello(self, now: float, identity: bytes, msg: m.Hello) -> list[SessionEffect]:
        old = self.consumers.get(identity)
        if old is not None and old.state is not Link.DEPARTED and (
                msg.nonce == old.hello_nonce if self.cfg.key is not None
                else msg.agent_metadata == old.hello_metadata):
            # a retransmit of the Hello this connection answered (or is answering): the
            # same answer again, so both sides keep one session
            return [Transmit(identity, old.ack_frame, again=True)] if old.ack_frame else []
        try:
            metadata, _ = self.check_hello(now, msg)
        except _Refused as exc:
            self.stats.auth_rejected += 1
            return self.refuse(identity, m.HelloReject(exc.reason, exc.field), msg.nonce)
        try:
            remote = KVLayout.from_wire(msg.layout)
            check_compatible(self.cfg.layout, remote)
        except LayoutMismatch as exc:
            return self.refuse(identity, m.HelloReject(str(exc), exc.field, repr(exc.local),
                                                       repr(exc.remote)), msg.nonce)
        except ProtocolError as exc:
            return self.refuse(identity, m.HelloReject(str(exc)), msg.nonce)
        out: list[SessionEffect] = []
        # A restarted consumer (its new connection, or the same one) replaces the old
        # incarnation: its transfers are given up before the agent takes the new metadata.
        for stale in (old, self.by_agent.get(msg.name)):
            if stale is not None and self.consumers.get(stale.identity) is stale:
                out += self.drop(stale, "consumer reconnected", abandon=True)
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        restarted = self.incarnations.get(msg.name, digest) != digest
        if msg.name in self.by_agent or restarted:
            # Dropped already (silent), its WRITEs left to end: the agent cannot take the
            # new metadata while it holds the old, so they are given up now. A new
            # incarnation whose predecessor was forgotten: that one's READs died with it.
            out.append(PeerDown(msg.name, "consumer restarted" if restarted
                                else "consumer reconnected", abandon=True))
        # Its frames' delays are judged only against a heartbeat period and a timeout that
        # make sense together (a Hello that says none, or nonsense, is not judged).
        judged = 0 < msg.heartbeat_s < msg.peer_timeout_s < math.inf
        peer = Accepted(identity, msg.name, remote, now, hello_nonce=msg.nonce,
                        hello_metadata=msg.agent_metadata, digest=digest,
                        heartbeat_s=msg.heartbeat_s if judged else 0.0,
                        peer_timeout_s=msg.peer_timeout_s if judged else 0.0)
        self.consumers[identity] = peer
        self.departed.pop(identity, None)
        out.append(Admit(identity, msg.name, metadata, remote))
        return out
