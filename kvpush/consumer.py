"""The decode side: connects to producers, registers destination blocks early (push) or
READs source blocks (pull), counts completions, and reports each request exactly once.

A result is reported only when the request's transfers have really ended: READY once every
expected part has landed (push: a ``Landed`` notification per producer part, counted in the
compiled completion table; pull: NIXL reports the READ done and the producer confirmed with
``PullHeld`` that it held the blocks), any other state once nothing can land any more (the
producer's WRITEs ended -- its AbortAck/Failed, then the Landed notification of every part it
had posted -- and this side's READs were polled to their end). Nothing is cancelled: NIXL's
release of a transfer in progress does not stop its bytes. Where that end cannot be learnt
(a producer lost, ``abort_grace_s`` passed) the result says ``blocks_safe=False``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from . import _core
from . import messages as m
from .agent import TransportConfig, XferState
from .auth import HELLO_MAX_SKEW_S, Opener, Sealer, check_key, new_nonce, session_key
from .endpoint import (
    RESULT_QUEUE,
    Endpoint,
    Timer,
    check_durations,
    check_timeout,
    close_dead_links,
    queue_result,
)
from .errors import (
    AuthenticationError,
    ClosedError,
    InvalidBlockIds,
    KvpushError,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    RequestAborted,
    TransferFailed,
    TransferTimeout,
)
from .layout import KVLayout, check_compatible
from .metrics import LIVE
from .plan import block_checksums, check_request_id, validate_block_ids
from .progress import ProgressPolicy
from .request import RequestState, TransferHandle, TransferMode, TransferResult

__all__ = ["Consumer", "ConsumerConfig", "new_xid"]

log = logging.getLogger("kvpush.consumer")


def new_xid() -> int:
    """A fresh transfer id (see :mod:`kvpush.messages`): random, 63 bits, never 0."""
    return int.from_bytes(os.urandom(8), "big") >> 1 | 1


def check_sharers(value: Any, what: str = "sharers") -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= m.MAX_SHARERS:
        raise ValueError(f"{what} must be an int in [1, {m.MAX_SHARERS}], got {value!r}")
    return value


@dataclass(frozen=True)
class ConsumerConfig:
    """Consumer settings (all durations in seconds).

    Parameters
    ----------
    request_timeout_s
        Default deadline of a request, from ``expect``/``pull`` to its data having landed
        (push: it covers the prefill itself).
    connect_timeout_s
        Default deadline of a handshake; Hellos are re-sent with backoff until then.
    heartbeat_s
        Interval of heartbeats to each producer.
    peer_timeout_s
        A producer silent this long is declared gone; its requests fail.
    abort_grace_s
        After an abort, timeout or failure, how long to wait for the request's transfers to
        end (see :class:`~kvpush.request.TransferResult`) before reporting it with
        ``blocks_safe=False``.
    lease_margin_s
        Pull: a READ is started only if the ticket's lease has at least this long left.
    verify
        Check every received block against the producer's per-block checksums (push: asked
        for in the registration; pull: the ticket must carry them, ``ProducerConfig.verify``).
        A mismatch fails the request, never silently. Requests with several producer parts
        are not verified (each part holds only a share of a block).
    auth_key
        Shared key (bytes, >= 16) to authenticate every control message and notification
        (see :mod:`kvpush.auth`); must equal the producers'. None: no authentication.
    """

    name: str | None = None
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 30.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 20.0
    abort_grace_s: float = 5.0
    lease_margin_s: float = 1.0
    coalesce: bool = True
    verify: bool = False
    auth_key: bytes | None = field(default=None, repr=False)
    transport: TransportConfig = field(default_factory=TransportConfig)
    progress: ProgressPolicy = field(default_factory=ProgressPolicy)

    def __post_init__(self) -> None:
        check_key(self.auth_key, "ConsumerConfig")
        check_durations(self, "request_timeout_s", "connect_timeout_s", "heartbeat_s",
                        "peer_timeout_s", "abort_grace_s")
        if self.heartbeat_s * 2 > self.peer_timeout_s:
            raise ValueError("ConsumerConfig.peer_timeout_s must be at least 2 * heartbeat_s")
        if self.lease_margin_s < 0:
            raise ValueError("ConsumerConfig.lease_margin_s must be >= 0")


@dataclass
class _Producer:
    address: str
    socket: zmq.Socket[Any]
    agent_name: str = ""
    layout: KVLayout | None = None
    last_seen: float = 0.0
    waiters: list[Callable[[str | None, KvpushError | None], None]] = field(default_factory=list)
    hello_timer: Timer | None = None
    hb_seq: int = 0
    # The Hello of this connection attempt: every retransmit is the same message (same
    # nonce and time), so a producer answers retransmits as duplicates of one Hello and
    # derives one session key (a new nonce per retransmit once gave the producer a new
    # key per Hello while this side kept the first answer's: issue 13, bug 2).
    hello: m.Hello | None = None
    hello_made: float = 0.0
    sealer: Sealer | None = None
    opener: Opener | None = None
    notif_sealer: Sealer | None = None
    notif_opener: Opener | None = None


@dataclass
class _Request:
    handle: TransferHandle
    ids: np.ndarray
    producers: list[str]          # agent names, index = part
    started: float
    deadline: Timer
    landed: set[int] = field(default_factory=set)    # parts whose data landed
    settled: set[int] = field(default_factory=set)   # parts that will write nothing more
    # parts announced in flight (Posted) and not landed -> when their hint arrived
    posted: dict[int, float] = field(default_factory=dict)
    reads: dict[str, Any] = field(default_factory=dict)  # pull: READs in flight, by producer
    read_bytes: int = 0          # bytes moved into the destination so far
    closing: RequestState | None = None   # set once an abort/timeout/failure began
    error: KvpushError | None = None
    waiting_acks: set[str] = field(default_factory=set)
    grace: Timer | None = None
    checksums: bytes | None = None   # pull with verify: the ticket's source checksums
    groups: int = 1                  # parts per producer (1, or one per layer)
    asked: bool = False              # Abort sent to the producers
    fence: set[int] = field(default_factory=set)   # posted parts whose Landed must come
    unheld: set[str] = field(default_factory=set)  # pull: producers yet to answer PullHeld
    unsafe: bool = False             # a transfer may still land: blocks_safe=False
    # pull: per producer, the source use read, when this side sent its PullBegin, the
    # latest end the producer's PullHeld guarantees (sent + hold_s), when the READ ended
    sids: dict[str, int] = field(default_factory=dict)
    began: dict[str, float] = field(default_factory=dict)
    held_until: dict[str, float] = field(default_factory=dict)
    read_end: dict[str, float] = field(default_factory=dict)

    @property
    def xid(self) -> int:
        return self.handle.xid

    def producer_of(self, part: int) -> str:
        return self.producers[part // self.groups]

    def parts_of(self, name: str) -> range:
        p = self.producers.index(name)
        return range(p * self.groups, (p + 1) * self.groups)

    def settled_producer(self, name: str) -> bool:
        return all(part in self.settled for part in self.parts_of(name))


@dataclass
class _Claim:
    """A pull promised (``Consumer.claim``) but not begun: its transfer id, and the
    source use claimed from each producer."""

    xid: int
    sids: dict[str, int]   # producer name -> sid
    sharers: int


_FAILED_CODES = {
    "aborted": (RequestState.ABORTED, RequestAborted),
    "timeout": (RequestState.TIMED_OUT, TransferTimeout),
    "lease_expired": (RequestState.TIMED_OUT, TransferTimeout),
}


class Consumer(Endpoint):
    """The decode side of kvpush.

    Parameters
    ----------
    layout
        This side's KV cache (registered with NIXL for the Consumer's lifetime).
    config
        :class:`ConsumerConfig`.
    on_finished
        Called on the Consumer's loop thread with each :class:`~kvpush.request.TransferResult`
        (keep it short; or leave it None and use handles / :meth:`get_finished`).
    """

    _role = "consumer"

    def __init__(self, layout: KVLayout, config: ConsumerConfig | None = None, *,
                 on_finished: Callable[[TransferResult], None] | None = None) -> None:
        config = config or ConsumerConfig()
        super().__init__(layout, name=config.name, transport=config.transport,
                         progress=config.progress, auth_key=config.auth_key)
        self.config = config
        self._on_finished = on_finished
        self._finished: deque[TransferResult] = deque(maxlen=RESULT_QUEUE)
        self._producers: dict[str, _Producer] = {}     # by address
        self._by_name: dict[str, _Producer] = {}       # by agent name, once connected
        self._requests: dict[str, _Request] = {}
        self._completions = _core.CompletionTable()
        # Seconds from a push part's Posted hint to its landing, smoothed, by size class
        # (bit length of its bytes): when to poll for the next landing (see _predicted).
        self._landing_s: dict[int, float] = {}
        # requests with push parts announced in flight (Posted) and not landed yet
        self._posting: dict[str, _Request] = {}
        self._reads: set[str] = set()
        # pulls claimed and not begun, by request id: written by the engine's threads
        # (claim, pull, abort) and by the loop (a producer lost), hence the lock
        self._claims: dict[str, _Claim] = {}
        self._claims_lock = threading.Lock()
        self._after(config.heartbeat_s, self._heartbeat)
        self._finalized = False
        self._start()

    # -- engine API (any thread) -----------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> str:
        """Handshake with the producer at ``address`` (e.g. ``Producer.address``); returns
        its name. Idempotent. Raises :class:`~kvpush.errors.LayoutMismatch` when the layouts
        cannot exchange blocks and :class:`~kvpush.errors.PeerUnavailable` when the producer
        does not answer within ``timeout``."""
        if not isinstance(address, str) or "://" not in address:
            raise ValueError(f"address must be a ZeroMQ endpoint like tcp://host:port, "
                             f"got {address!r}")
        timeout = self.config.connect_timeout_s if timeout is None \
            else check_timeout(timeout, "connect timeout")
        done: list[tuple[str | None, KvpushError | None]] = []
        event = threading.Event()

        def on_result(name: str | None, error: KvpushError | None) -> None:
            done.append((name, error))
            event.set()

        self._call_soon(lambda: self._connect(address, timeout, on_result))
        if not event.wait(timeout + 5.0):
            raise PeerUnavailable(f"handshake with {address} did not finish in {timeout} s")
        name, error = done[0]
        if error is not None:
            raise error
        assert name is not None
        return name

    def expect(self, request_id: str, block_ids: Any, producers: str | Sequence[str], *,
               timeout: float | None = None, layerwise: bool = False,
               source_tail: bool = False, sharers: int | Sequence[int] = 1) -> TransferHandle:
        """Push: the decode engine allocated ``block_ids`` for ``request_id``; register them
        with each producer (a producer name from :meth:`connect`, or one per rank that owes
        data). Returns at once; the handle reports the result.

        ``layerwise``: each producer writes every layer as soon as it is final
        (``Producer.layer_done``) and the request is READY once every layer of every
        producer has landed.

        ``source_tail``: ``block_ids`` receive only the *last* ``len(block_ids)`` of the
        producer's source blocks (this side holds the earlier ones already: a prefix-cache
        hit); without it the two counts must match.

        ``sharers``: how many consumer endpoints take a share of each producer's source
        for this request (heterogeneous TP: decode ranks each written their head share of
        one prefill request); one int for every producer, or one per producer. The
        producer holds its source until that many have finished or given up.

        The handle's ``xid`` (and its result's) names this use of ``request_id``."""
        rid = self._check_request_id(request_id)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        names = [producers] if isinstance(producers, str) else list(producers)
        if not names:
            raise ValueError("expect needs at least one producer")
        if isinstance(sharers, (list, tuple)):
            shares = [check_sharers(s, "each of sharers") for s in sharers]
            if len(shares) != len(names):
                raise ValueError(f"sharers names {len(shares)} counts for {len(names)} "
                                 "producers")
        else:
            shares = [check_sharers(sharers)] * len(names)
        timeout = self.config.request_timeout_s if timeout is None \
            else check_timeout(timeout, "expect timeout")
        groups = self.layout.num_layers if layerwise else 1
        handle = TransferHandle(rid, TransferMode.PUSH, new_xid())
        self._call_soon(lambda: self._register(handle, ids, names, timeout, groups,
                                               source_tail, shares))
        return handle

    def pull(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
             block_ids: Any, *, timeout: float | None = None,
             source_tail: bool = False, sharers: int = 1) -> TransferHandle:
        """Pull: READ the blocks named by a :class:`~kvpush.messages.PullTicket` (or by one
        ticket per producer rank, for the same request) into ``block_ids``. Connects to a
        ticket's producer first if needed (blocking, at most ``connect_timeout_s`` and never
        past the tickets' lease or ``timeout``). ``source_tail``: read only the last
        ``len(block_ids)`` blocks of each ticket (see :meth:`expect`). ``sharers``: how many
        consumer endpoints read a share of each ticket's source (see :meth:`expect`).

        A pull of the tickets a :meth:`claim` named continues that claim (same ``xid``;
        the producer holds a claimed source past the ticket's lease, so only ``timeout``
        bounds the READ)."""
        rid, parsed = self._parse_tickets(tickets, "pull")
        check_sharers(sharers)
        dst = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        sources = [m.decode_ids(t.block_ids) for t in parsed]
        if source_tail:
            for t, src in zip(parsed, sources, strict=True):
                if len(dst) > len(src):
                    raise InvalidBlockIds(f"source_tail: block_ids has {len(dst)} blocks, "
                                          f"the ticket of {t.producer} only {len(src)}")
            skip = [len(src) - len(dst) for src in sources]
            sources = [src[k:] for src, k in zip(sources, skip, strict=True)]
            parsed = [msgspec.structs.replace(t, checksums=t.checksums[8 * k:])
                      if t.checksums else t for t, k in zip(parsed, skip, strict=True)]
        timeout = self.config.request_timeout_s if timeout is None \
            else check_timeout(timeout, "pull timeout")

        def budget() -> float:  # seconds left to the READ: the timeout and every lease
            return min(timeout, self._lease_left(parsed))

        with self._claims_lock:
            claimed = rid in self._claims
        self._connect_tickets(parsed, budget if not claimed else lambda: timeout)
        for t, src in zip(parsed, sources, strict=True):
            peer = self._by_name.get(t.producer)
            same_blocks = peer is None or peer.layout is None or \
                peer.layout.tokens_per_block == self.layout.tokens_per_block
            if same_blocks and len(src) != len(dst):
                raise InvalidBlockIds(f"the ticket of {t.producer} names {len(src)} source "
                                      f"blocks but block_ids has {len(dst)}")
        with self._claims_lock:
            claim = self._claims.pop(rid, None)
        if claim is not None and claim.sids != {t.producer: t.sid for t in parsed}:
            # Claimed from another source use (an earlier prefill of this id): give it up.
            stale = claim
            self._call_soon(lambda: self._abort_claim(rid, stale, "claim superseded"))
            claim = None
        left = timeout if claim is not None else budget()
        handle = TransferHandle(rid, TransferMode.PULL,
                                claim.xid if claim is not None else new_xid())
        self._call_soon(lambda: self._read(handle, parsed, sources, dst, left, sharers))
        return handle

    def claim(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
              sharers: int = 1) -> int:
        """Pull later: this consumer will READ the tickets' blocks but cannot yet (its
        engine has no free blocks). Asks each ticket's producer to hold its source past the
        ticket's lease while this consumer is connected (bounded by the producer's
        ``max_wait_s``). A later :meth:`pull` of the same tickets continues the claim;
        :meth:`abort` of the request gives it up. Connects first if needed (as
        :meth:`pull`). Returns the claim's transfer id (the pull's ``xid``)."""
        rid, parsed = self._parse_tickets(tickets, "claim")
        check_sharers(sharers)

        def budget() -> float:
            return self._lease_left(parsed)

        self._connect_tickets(parsed, budget)
        if budget() <= 0:
            raise TransferTimeout(f"the pull ticket's lease for {rid!r} has run out")
        claim = _Claim(new_xid(), {t.producer: t.sid for t in parsed}, sharers)
        with self._claims_lock:
            if rid in self._claims:
                raise InvalidBlockIds(f"request {rid!r} is already claimed")
            self._claims[rid] = claim
        self._call_soon(lambda: self._send_claim(rid, claim))
        return claim.xid

    def abort(self, request_id: str, reason: str = "aborted by consumer") -> None:
        """Give up ``request_id``; its result (ABORTED) comes once the blocks are safe. A
        claimed request not pulled yet is given up at its producers (no result: it has no
        handle)."""
        with self._claims_lock:
            claim = self._claims.pop(request_id, None)
        if claim is not None:
            self._call_soon(lambda: self._abort_claim(request_id, claim, reason))
        self._call_soon(lambda: self._abort(request_id, RequestState.ABORTED,
                                            RequestAborted(reason)))

    def _parse_tickets(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
                       what: str) -> tuple[str, list[m.PullTicket]]:
        batch = [tickets] if isinstance(tickets, (m.PullTicket, bytes, bytearray)) \
            else list(tickets)
        parsed = [m.PullTicket.from_bytes(bytes(t)) if isinstance(t, (bytes, bytearray))
                  else t for t in batch]
        if not parsed:
            raise ValueError(f"{what} needs at least one ticket")
        rid = self._check_request_id(parsed[0].request_id)
        if any(t.request_id != rid for t in parsed):
            raise InvalidBlockIds(f"all tickets of one {what} must be for the same request")
        if len({t.producer for t in parsed}) != len(parsed):
            raise InvalidBlockIds(f"two tickets of one {what} name the same producer")
        return rid, parsed

    def _lease_left(self, tickets: list[m.PullTicket]) -> float:
        """Seconds until the first of the tickets' leases ends, less ``lease_margin_s``."""
        now = time.time()
        return min(t.lease_s - (now - t.issued_at) - self.config.lease_margin_s
                   for t in tickets)

    def _connect_tickets(self, tickets: list[m.PullTicket],
                         budget: Callable[[], float]) -> None:
        for t in tickets:
            # A handshake that outlasts the tickets' lease cannot make this pull succeed:
            # the engine's thread waits no longer than that (an expired pull is TIMED_OUT).
            wait = min(self.config.connect_timeout_s, budget())
            if t.producer not in self._by_name and wait > 0:
                name = self.connect(t.address, timeout=wait)
                if name != t.producer:
                    raise PeerUnavailable(f"{t.address} is {name!r}, the ticket names "
                                          f"{t.producer!r}")

    def get_finished(self) -> list[TransferResult]:
        """Results since the last call (for engines that poll rather than take callbacks)."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def stats(self) -> dict[str, int]:
        return self._stats.as_dict()

    @property
    def pending(self) -> int:
        return len(self._requests)

    def producers(self) -> list[str]:
        """Names of producers connected now."""
        return list(self._by_name)

    def producer_layout(self, name: str) -> KVLayout:
        """The KV layout a connected producer announced (e.g. its head shard, for
        :func:`kvpush.layout.covering_producers`)."""
        peer = self._by_name.get(name)
        if peer is None or peer.layout is None:
            raise PeerUnavailable(f"not connected to {name!r}")
        return peer.layout

    @staticmethod
    def _check_request_id(request_id: Any) -> str:
        return check_request_id(request_id)

    # -- loop: connections -----------------------------------------------------------------
    def _connect(self, address: str, timeout: float,
                 on_result: Callable[[str | None, KvpushError | None], None]) -> None:
        peer = self._producers.get(address)
        if peer is not None and peer.agent_name:
            on_result(peer.agent_name, None)
            return
        if peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.name.encode())
            close_dead_links(sock, self.config.peer_timeout_s)
            sock.connect(address)
            peer = _Producer(address, sock)
            self._producers[address] = peer
            self._add_socket(sock, self._dealer_handler(peer))
            self._send_hello(peer, time.monotonic() + timeout, 0.05)
        peer.waiters.append(on_result)

    def _dealer_handler(self, peer: _Producer) -> Callable[[zmq.Socket[Any]], None]:
        return lambda sock: self._on_dealer(peer, sock)

    def _send_hello(self, peer: _Producer, deadline: float, delay: float) -> None:
        if peer.agent_name or self._producers.get(peer.address) is not peer:
            return
        now = time.monotonic()
        if now >= deadline:
            self._connect_failed(peer, PeerUnavailable(f"no answer from {peer.address}"))
            return
        # One Hello per connection attempt, re-sent as is; renewed only before the
        # producer would find it stale (an attempt longer than HELLO_MAX_SKEW_S / 2).
        if peer.hello is None or now - peer.hello_made > HELLO_MAX_SKEW_S / 2:
            peer.hello_made = now
            peer.hello = m.Hello(self.name, self._agent.metadata(), self.layout.to_wire()) \
                if self._key is None else \
                m.Hello(self.name, self._agent.metadata(), self.layout.to_wire(),
                        new_nonce(), time.time())
        # A fresh Sealer each time: counter 1 again, so a retransmit is the same frame.
        self._send(peer.socket, peer.hello,
                   sealer=None if self._key is None else Sealer(self._key, b"hello"))
        # Re-send with backoff: the producer may not be up yet, or a starved host may have
        # missed it; a Hello is idempotent (the producer answers a duplicate as the first).
        peer.hello_timer = self._at(min(deadline, now + delay),
                                    lambda: self._send_hello(peer, deadline, min(delay * 2, 2.0)))

    def _connect_failed(self, peer: _Producer, error: KvpushError) -> None:
        if peer.hello_timer is not None:
            peer.hello_timer.cancel()
        self._producers.pop(peer.address, None)
        self._remove_socket(peer.socket)
        for waiter in peer.waiters:
            waiter(None, error)
        peer.waiters.clear()

    def _on_dealer(self, peer: _Producer, sock: zmq.Socket[Any]) -> None:
        for frames in self._recv_all(sock):
            if self._producers.get(peer.address) is not peer:
                return
            try:
                if len(frames) != 1:
                    raise ProtocolError("expected one frame")
                msg = self._decode(peer, frames[0])
            except AuthenticationError as exc:
                self._stats.auth_rejected += 1
                log.warning("%s: rejected control frame: %s", self.name, exc)
                continue
            except ProtocolError as exc:
                self._stats.messages_rejected += 1
                log.warning("%s: rejected control frame: %s", self.name, exc)
                continue
            peer.last_seen = time.monotonic()
            if isinstance(msg, m.HelloAck):
                self._on_hello_ack(peer, msg)
            elif isinstance(msg, m.HelloReject):
                if peer.agent_name:
                    continue
                error: KvpushError
                if msg.field == "auth_key":
                    error = AuthenticationError(f"{peer.address} refused the handshake: "
                                                f"{msg.reason}")
                elif msg.field:
                    error = LayoutMismatch(msg.field, msg.local, msg.remote)
                else:
                    error = PeerUnavailable(msg.reason)
                self._connect_failed(peer, error)
                return
            elif not peer.agent_name:
                self._stats.messages_rejected += 1
            elif isinstance(msg, m.Posted):
                req = self._live(msg.request_id, msg.xid)
                if msg.empty and req is not None:
                    self._on_landed(peer.agent_name, m.Landed(msg.request_id, msg.xid,
                                                              msg.part))
                elif (req is not None and 0 <= msg.part < len(req.producers) * req.groups
                        and msg.part not in req.settled and msg.part not in req.posted):
                    req.posted[msg.part] = time.monotonic()
                    self._posting[msg.request_id] = req
            elif isinstance(msg, m.Failed):
                self._on_failed(peer, msg)
            elif isinstance(msg, m.AbortAck):
                self._on_ack(peer, msg.request_id, msg.xid, msg.errored, msg.unfenced)
            elif isinstance(msg, m.PullHeld):
                self._on_held(peer, msg)
            elif isinstance(msg, m.Abort):
                self._on_producer_abort(peer, msg)
            elif isinstance(msg, m.HeartbeatAck):
                pass
            elif isinstance(msg, m.Bye):
                self._lose_producer(peer, "producer closed")
                return
            else:
                self._stats.messages_rejected += 1

    def _decode(self, peer: _Producer, frame: bytes) -> m.Message:
        if peer.agent_name or self._key is None:
            return m.decode(frame, peer.opener)
        # Handshake with a key: a sealed HelloAck echoing one of our nonces, or a plain
        # HelloReject (a producer without our key can only say no).
        if not m.is_sealed(frame):
            msg = m.decode(frame)
            if not isinstance(msg, m.HelloReject):
                raise AuthenticationError(f"unauthenticated {type(msg).__name__}")
            return msg
        msg = m.decode(frame, Opener(self._key, b"hello-ack", replay=False))
        if not isinstance(msg, m.HelloAck) or peer.hello is None \
                or msg.echo != peer.hello.nonce:
            raise AuthenticationError("handshake answer does not match our Hello")
        return msg

    def _live(self, rid: str, xid: int) -> _Request | None:
        """The live request that a message about use ``(rid, xid)`` is for; None (and the
        message counted stale: it changes nothing) when that use is not live here."""
        req = self._requests.get(rid)
        if req is None or req.xid != xid:
            self._stats.stale_messages += 1
            return None
        return req

    def _tell(self, peer: _Producer, msg: m.Message) -> None:
        self._send(peer.socket, msg, sealer=peer.sealer)

    def _on_hello_ack(self, peer: _Producer, msg: m.HelloAck) -> None:
        if peer.agent_name:
            return  # a duplicate answer to a re-sent Hello
        old = self._by_name.get(msg.name)
        if old is not None and old is not peer:
            # The same producer, restarted at another address before we noticed: its old
            # incarnation's state must go before NIXL accepts the new metadata.
            self._lose_producer(old, f"restarted at {peer.address}")
        try:
            remote = KVLayout.from_wire(msg.layout)
            check_compatible(self.layout, remote)
            name = self._agent.add_peer(msg.agent_metadata, remote)
        except KvpushError as exc:
            self._connect_failed(peer, exc)
            return
        if name != msg.name:
            self._agent.remove_peer(name)
            self._connect_failed(peer, ProtocolError(f"producer calls itself {msg.name!r} but "
                                                     f"its NIXL agent is {name!r}"))
            return
        if peer.hello_timer is not None:
            peer.hello_timer.cancel()
        if self._key is not None:
            session = session_key(self._key, msg.echo, msg.nonce)
            peer.sealer, peer.opener = Sealer(session, b"c2p"), Opener(session, b"p2c")
            peer.notif_sealer = Sealer(session, b"c2p-notif")
            peer.notif_opener = Opener(session, b"p2c-notif")
        peer.agent_name = name
        peer.layout = remote
        self._by_name[name] = peer
        for waiter in peer.waiters:
            waiter(name, None)
        peer.waiters.clear()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for peer in list(self._by_name.values()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                self._lose_producer(peer, f"no answer for {self.config.peer_timeout_s} s")
                continue
            peer.hb_seq += 1
            self._tell(peer, m.Heartbeat(peer.hb_seq))
        self._after(self.config.heartbeat_s, self._heartbeat)

    def _lose_producer(self, peer: _Producer, why: str) -> None:
        if self._producers.get(peer.address) is not peer:
            return
        log.info("%s: lost producer %s: %s", self.name, peer.agent_name or peer.address, why)
        self._stats.peers_lost += 1
        name = peer.agent_name
        del self._producers[peer.address]
        self._by_name.pop(name, None)
        self._remove_socket(peer.socket)
        with self._claims_lock:  # its claims cannot be held any more; a pull starts anew
            for rid in [r for r, c in self._claims.items() if name in c.sids]:
                del self._claims[rid]
        for rid, req in list(self._requests.items()):
            if name not in req.producers:
                continue
            # What it may still have in flight cannot be waited for any more: a READ is
            # abandoned, and a push part that has not landed may land later: its WRITE may
            # have been posted even if its Posted hint was lost with the link (over TCP a
            # cut link keeps UCX's connection; see blocks_safe).
            if name in req.reads:
                self._abandon_read(rid, req, name)
            for part in req.parts_of(name):
                if req.handle.mode is TransferMode.PUSH and part not in req.settled:
                    req.unsafe = True
                req.fence.discard(part)
                self._settle(req, part)
            req.unheld.discard(name)
            req.waiting_acks.discard(name)
            if req.closing is None:
                self._close_request(rid, RequestState.FAILED,
                                    PeerUnavailable(f"producer {name} lost: {why}"), ask=True)
            else:
                self._try_finish(rid)
        self._agent.remove_peer(name)

    # -- loop: push ------------------------------------------------------------------------
    def _register(self, handle: TransferHandle, ids: np.ndarray, names: list[str],
                  timeout: float, groups: int, tail: bool, sharers: list[int]) -> None:
        rid = handle.request_id
        now = time.monotonic()
        if rid in self._requests:
            # Its own result (its own xid and blocks): never taken for the live request's.
            self._report(handle, RequestState.FAILED,
                         InvalidBlockIds(f"request {rid!r} is already pending"), now, 0,
                         ids=ids)
            return
        missing = [n for n in names if n not in self._by_name]
        if missing:
            self._report(handle, RequestState.FAILED,
                         PeerUnavailable(f"not connected to {missing}"), now, 0, ids=ids)
            return
        deadline = self._after(timeout, lambda: self._expire(rid))
        self._requests[rid] = _Request(handle, ids, names, now, deadline, groups=groups)
        LIVE.add("requests_pending", 1)
        self._completions.expect(rid, len(names) * groups)
        payload = m.encode_ids(ids)
        verify = self.config.verify and len(names) * groups == 1
        for index, (name, share) in enumerate(zip(names, sharers, strict=True)):
            self._tell(self._by_name[name],
                       m.Register(rid, handle.xid, payload, index, timeout, verify, groups,
                                  tail, share))

    def _on_failed(self, peer: _Producer, msg: m.Failed) -> None:
        if self._drop_claim(peer, msg.request_id, msg.xid, f"{msg.code}: {msg.reason}"):
            return
        req = self._live(msg.request_id, msg.xid)
        if req is None or peer.agent_name not in req.producers:
            return
        if req.closing is not None:
            self._on_ack(peer, msg.request_id, msg.xid, msg.errored, msg.unfenced)
            return
        state, cls = _FAILED_CODES.get(msg.code, (RequestState.FAILED, TransferFailed))
        error = cls(f"producer {peer.agent_name}: {msg.code}: {msg.reason}")
        # This producer's WRITEs have all ended: it will write nothing more.
        req.unsafe |= msg.unfenced
        self._settle_producer(req, peer.agent_name, msg.errored)
        req.unheld.discard(peer.agent_name)
        self._close_request(msg.request_id, state, error, ask=True)

    def _on_producer_abort(self, peer: _Producer, msg: m.Abort) -> None:
        """The producer gave the request up while its WRITE was in flight: the request ends
        ABORTED once that WRITE has (its Failed follows, then the Landed of what was
        posted)."""
        if self._drop_claim(peer, msg.request_id, msg.xid, msg.reason):
            return
        req = self._live(msg.request_id, msg.xid)
        if req is None or req.closing is not None or peer.agent_name not in req.producers:
            return
        self._close_request(msg.request_id, RequestState.ABORTED,
                            RequestAborted(f"producer {peer.agent_name}: {msg.reason}"),
                            ask=True)

    def _on_ack(self, peer: _Producer, rid: str, xid: int, errored: list[int],
                unfenced: bool) -> None:
        """The producer's WRITEs of ``rid`` have all ended (``AbortAck``, or ``Failed`` for a
        request that was closing already)."""
        req = self._live(rid, xid)
        if req is None or req.closing is None or peer.agent_name not in req.producers:
            return
        req.unsafe |= unfenced
        self._settle_producer(req, peer.agent_name, errored)
        req.waiting_acks.discard(peer.agent_name)
        self._try_finish(rid)

    def _settle_producer(self, req: _Request, name: str, errored: Iterable[int]) -> None:
        """Producer ``name`` writes nothing more for ``req``. A part it announced (Posted)
        and whose WRITE did not end in error may still have bytes on the way, ahead of its
        Landed notification: the request waits for that notification (its fence)."""
        errored = set(errored)
        for part in req.parts_of(name):
            if part in req.posted and part not in errored:
                req.fence.add(part)
            else:
                self._settle(req, part)

    def _on_held(self, peer: _Producer, msg: m.PullHeld) -> None:
        rid = msg.request_id
        req = self._live(rid, msg.xid)
        if req is None or peer.agent_name not in req.unheld:
            return
        req.unheld.discard(peer.agent_name)
        # The producer holds the blocks hold_s from its receipt of our PullBegin, which is
        # after we sent it: counted from our send, the guarantee is never overstated. (A
        # NaN or negative hold guarantees nothing.)
        hold = msg.hold_s if msg.hold_s >= 0 else -math.inf
        req.held_until[peer.agent_name] = req.began.get(peer.agent_name, -math.inf) + hold
        if not req.unheld and not req.reads and req.closing is None:
            self._pull_done(rid, req)

    # -- loop: claims ----------------------------------------------------------------------
    def _send_claim(self, rid: str, claim: _Claim) -> None:
        for name, sid in claim.sids.items():
            peer = self._by_name.get(name)
            if peer is None:  # lost meanwhile (its claims went with it)
                continue
            self._tell(peer, m.Claim(rid, claim.xid, sid, claim.sharers))

    def _abort_claim(self, rid: str, claim: _Claim, reason: str) -> None:
        for name in claim.sids:
            peer = self._by_name.get(name)
            if peer is not None:
                self._tell(peer, m.Abort(rid, claim.xid, reason))

    def _drop_claim(self, peer: _Producer, rid: str, xid: int, why: str) -> bool:
        """A producer refused or gave up a claim (``Failed`` / ``Abort`` with its xid): drop
        it, so a later pull starts afresh (and learns the source's fate itself)."""
        with self._claims_lock:
            claim = self._claims.get(rid)
            if claim is None or claim.xid != xid or peer.agent_name not in claim.sids:
                return False
            del self._claims[rid]
        log.info("%s: claim of %r dropped by %s: %s", self.name, rid, peer.agent_name, why)
        return True

    # -- loop: pull ------------------------------------------------------------------------
    def _read(self, handle: TransferHandle, tickets: list[m.PullTicket],
              sources: list[np.ndarray], dst: np.ndarray, budget: float,
              sharers: int) -> None:
        rid = handle.request_id
        now = time.monotonic()
        error: KvpushError | None = None
        state = RequestState.FAILED
        peers = [self._by_name.get(t.producer) for t in tickets]
        plans = []
        if rid in self._requests:
            error = InvalidBlockIds(f"request {rid!r} is already pending")
        elif budget <= 0:
            state, error = RequestState.TIMED_OUT, TransferTimeout(
                f"the pull ticket's lease for {rid!r} has run out")
        elif any(p is None or p.layout is None for p in peers):
            error = PeerUnavailable(f"not connected to all of {[t.producer for t in tickets]}")
        elif self.config.verify and len(tickets) == 1 and \
                len(tickets[0].checksums) != 8 * len(dst):
            error = TransferFailed(f"verify is on but the ticket for {rid!r} carries no "
                                   "per-block checksums (set ProducerConfig.verify)")
        else:
            try:
                for peer, src in zip(peers, sources, strict=True):
                    assert peer is not None
                    plans.append(self._agent.link(peer.agent_name).plan(
                        dst, src, self.layout.num_blocks, self.layout.num_regions,
                        self.config.coalesce))
            except KvpushError as exc:
                error = exc
        if error is not None:
            self._report(handle, state, error, now, 0, ids=dst)
            return
        deadline = self._after(budget, lambda: self._expire(rid))
        names = [t.producer for t in tickets]
        req = _Request(handle, dst, names, now, deadline)
        req.sids = {t.producer: t.sid for t in tickets}
        xid = handle.xid
        if self.config.verify and len(tickets) == 1:
            req.checksums = tickets[0].checksums
        self._requests[rid] = req
        LIVE.add("requests_pending", 1)
        for peer, plan in zip(peers, plans, strict=True):
            assert peer is not None
            sid = req.sids[peer.agent_name]
            nbytes = len(plan.local_indices) * self._agent.link(peer.agent_name).desc_bytes
            notif = m.encode(m.PullDone(rid, xid, sid, nbytes, sharers), peer.notif_sealer)
            try:
                if plan.num_blocks == 0:  # see Posted.empty: no NIXL traffic for nothing
                    self._tell(peer, m.PullDone(rid, xid, sid, 0, sharers))
                    continue
                # The producer's PullHeld answer gates READY: ask before the READ so the
                # round trip overlaps it (on a host the READ often ends inside the post).
                # Its hold_s counts from this moment (see _on_held).
                req.began[peer.agent_name] = time.monotonic()
                self._tell(peer, m.PullBegin(rid, xid, sid, sharers))
                xfer = self._agent.post("READ", peer.agent_name, plan.local_indices,
                                        plan.remote_indices, notif)
            except KvpushError as exc:
                self._close_request(rid, RequestState.FAILED, exc, ask=True)
                # no READ: the source need not wait
                self._tell(peer, m.PullDone(rid, xid, sid, 0, sharers))
                return
            req.reads[peer.agent_name] = xfer
            req.unheld.add(peer.agent_name)
            req.read_bytes += nbytes
            LIVE.add("transfers_in_flight", 1)
            self._stats.transfers_posted += 1
            self._stats.descriptors_posted += plan.num_descriptors
        if req.reads:
            self._reads.add(rid)
            self._check_reads(rid)  # on a host UCX often finishes inside the post
        else:
            self._finish(rid, RequestState.READY, None)

    def _end_read(self, rid: str, req: _Request, name: str) -> None:
        del req.reads[name]
        if not req.reads:
            self._reads.discard(rid)
        LIVE.add("transfers_in_flight", -1)

    def _abandon_read(self, rid: str, req: _Request, name: str) -> None:
        """Give up a READ without its end: NIXL's release does not stop a READ in progress,
        whose data may land later, so the request's blocks are not safe."""
        xfer = req.reads[name]
        if self._agent.state(xfer) is XferState.IN_PROGRESS:
            req.unsafe = True
            self._stats.transfers_abandoned += 1
        if not self._agent.release(xfer):
            log.warning("%s: NIXL refused to release the READ of %r", self.name, rid)
        self._end_read(rid, req, name)

    # -- loop: progress --------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._posting) or bool(self._reads)

    def _check_reads(self, rid: str) -> bool:
        """Poll a pull's READs; end the request once none is in flight. True if any ended."""
        req = self._requests[rid]
        moved = False
        for name, xfer in list(req.reads.items()):
            state = self._agent.state(xfer)
            if state is XferState.IN_PROGRESS:
                continue
            moved = True
            req.read_end[name] = time.monotonic()
            self._agent.release(xfer)
            self._end_read(rid, req, name)
            if state is not XferState.DONE and req.closing is None:
                self._close_request(rid, RequestState.FAILED,
                                    TransferFailed(f"READ of {rid!r} from {name} failed"),
                                    ask=True)
        if req.reads or rid not in self._requests:
            return moved
        if req.closing is not None:  # aborted or failed while reading: it has ended now
            self._try_finish(rid)
        elif not req.unheld:  # else READY waits for the producers' PullHeld
            self._pull_done(rid, req)
        return moved

    def _pull_done(self, rid: str, req: _Request) -> None:
        """Every READ is done and every producer confirmed it held the blocks."""
        for name, ended in req.read_end.items():
            late = ended - req.held_until.get(name, -math.inf)
            if late > 0:
                # The producer may have released the blocks before our READ ended: what it
                # read is not trusted. The READ has ended, so the blocks are safe.
                self._close_request(rid, RequestState.FAILED, TransferFailed(
                    f"READ of {rid!r} from {name} ended {late:.3f} s past the hold the "
                    "producer guaranteed (PullHeld.hold_s): its data is not trusted"),
                    ask=False)
                return
        self._stats.bytes_moved += req.read_bytes
        self._stats.blocks_moved += len(req.ids)
        mismatch = self._verify(req, req.checksums)
        if mismatch is None:
            self._finish(rid, RequestState.READY, None)
        else:
            self._close_request(rid, RequestState.FAILED, mismatch, ask=False)

    def _poll_transfers(self) -> bool:
        moved = False
        for rid in list(self._reads):
            moved |= self._check_reads(rid)
        if self._posting:
            for sender, msg in self._notifications():
                moved = True
                if isinstance(msg, m.Landed):
                    self._on_landed(sender, msg)
                else:
                    self._stats.messages_rejected += 1
        return moved

    def _notif_opener(self, sender: str) -> tuple[bool, Opener | None]:
        peer = self._by_name.get(sender)
        return peer is not None, peer.notif_opener if peer is not None else None

    def _on_landed(self, sender: str, msg: m.Landed) -> None:
        """Part ``msg.part`` of a push has landed (NIXL notification after its WRITE, or an
        empty part announced over the control socket)."""
        req = self._live(msg.request_id, msg.xid)
        if req is None or not 0 <= msg.part < len(req.producers) * req.groups \
                or req.producer_of(msg.part) != sender:
            return
        arrival = self._completions.arrive(msg.request_id, msg.part)
        if arrival not in (_core.Arrival.PENDING, _core.Arrival.COMPLETE):
            return
        hinted = req.posted.get(msg.part)
        if hinted is not None:
            size = self._size_class(req)
            took = time.monotonic() - hinted
            last = self._landing_s.get(size)
            self._landing_s[size] = took if last is None else 0.75 * last + 0.25 * took
        req.landed.add(msg.part)
        self._settle(req, msg.part)
        if msg.part % req.groups == 0:
            self._stats.blocks_moved += len(req.ids)
        req.read_bytes += msg.nbytes  # push: bytes landed so far
        self._stats.bytes_moved += msg.nbytes
        if req.closing is None and len(req.producers) * req.groups == 1 and self.config.verify:
            mismatch = self._verify(req, msg.checksums)
            if mismatch is not None:
                self._close_request(msg.request_id, RequestState.FAILED, mismatch, ask=False)
                return
        if req.closing is not None:
            req.fence.discard(msg.part)
            name = req.producer_of(msg.part)
            if req.settled_producer(name):
                req.waiting_acks.discard(name)
            self._try_finish(msg.request_id)
        elif arrival == _core.Arrival.COMPLETE:
            self._finish(msg.request_id, RequestState.READY, None)

    def _verify(self, req: _Request, checksums: bytes | None) -> KvpushError | None:
        """None when the landed blocks match the producer's checksums (or verify is off)."""
        if checksums is None:
            return None
        if len(checksums) != 8 * len(req.ids):
            return TransferFailed(f"{req.handle.request_id!r}: the producer sent "
                                  f"{len(checksums) // 8} checksums for {len(req.ids)} blocks")
        want = np.frombuffer(checksums, dtype="<u8")
        got = block_checksums(self.layout, req.ids)
        bad = np.nonzero(got != want)[0]
        if len(bad) == 0:
            return None
        self._stats.checksum_mismatches += len(bad)
        return TransferFailed(f"{req.handle.request_id!r}: {len(bad)} block(s) differ from the "
                              f"source after transfer, e.g. block {int(req.ids[bad[0]])}")

    def _size_class(self, req: _Request) -> int:
        """Bit length of the bytes one part of ``req`` moves (all regions, whole blocks)."""
        return (len(req.ids) * self.layout.block_bytes * self.layout.num_regions
                // req.groups).bit_length()

    def _predicted(self) -> tuple[float, float] | None:
        """The earliest predicted landing of a posted push part still to come: from the
        smoothed hint-to-landing time of its size class, polled closely for a quarter of
        that time (at least the policy's spin)."""
        if not self._posting:
            return None
        now = time.monotonic()
        best: tuple[float, float] | None = None
        spin = self._progress_policy.spin_s
        for req in self._posting.values():
            took = self._landing_s.get(self._size_class(req))
            if took is None:
                continue
            for hinted in req.posted.values():
                start = hinted + took
                end = start + max(0.25 * took, spin)
                if end > now and (best is None or start < best[0]):
                    best = (start, end)
        return best

    def _settle(self, req: _Request, part: int) -> None:
        """Part ``part`` of ``req`` will write nothing more."""
        req.settled.add(part)
        if req.posted.pop(part, None) is not None and not req.posted:
            self._posting.pop(req.handle.request_id, None)

    # -- loop: endings ---------------------------------------------------------------------
    def _expire(self, rid: str) -> None:
        req = self._requests.get(rid)
        if req is not None and req.closing is None:
            what = "READ" if req.handle.mode is TransferMode.PULL else "data"
            self._abort(rid, RequestState.TIMED_OUT,
                        TransferTimeout(f"{what} for {rid!r} did not land in time"))

    def _abort(self, rid: str, state: RequestState, error: KvpushError) -> None:
        req = self._requests.get(rid)
        if req is None or req.closing is not None:
            return
        self._close_request(rid, state, error, ask=True)

    def _close_request(self, rid: str, state: RequestState, error: KvpushError | None,
                       ask: bool) -> None:
        """Begin ending a request that did not succeed: ask the producers to abort, and
        report once nothing can land any more: READs polled to their end, and for push each
        producer's confirmation that its WRITEs ended, then the Landed notification of each
        part it had posted (the notification travels behind the bytes). Nothing is
        cancelled: NIXL's release of a transfer in progress does not stop its bytes."""
        req = self._requests[rid]
        req.closing, req.error = state, error
        req.deadline.cancel()
        if ask:
            self._ask_abort(rid, req)
        if not self._try_finish(rid) and req.grace is None:
            req.grace = self._after(self.config.abort_grace_s, lambda: self._grace_over(rid))

    def _ask_abort(self, rid: str, req: _Request) -> None:
        """Send Abort to the request's producers (once); push: wait for the AbortAck of
        each that may still be writing."""
        if req.asked:
            return
        req.asked = True
        reason = str(req.error) if req.error else "aborted"
        for name in req.producers:
            peer = self._by_name.get(name)
            if peer is None:
                continue
            self._tell(peer, m.Abort(rid, req.xid, reason))
            if req.handle.mode is TransferMode.PUSH and any(
                    p not in req.settled and p not in req.fence for p in req.parts_of(name)):
                req.waiting_acks.add(name)

    def _try_finish(self, rid: str) -> bool:
        """Report a closing request once nothing of it is in flight; True if reported."""
        req = self._requests.get(rid)
        if req is None or req.closing is None or req.reads or req.waiting_acks or req.fence:
            return False
        self._finish(rid, req.closing, req.error)
        return True

    def _grace_over(self, rid: str) -> None:
        """``abort_grace_s`` after the close began, something may still land: report the
        request with ``blocks_safe=False``."""
        req = self._requests.get(rid)
        if req is None or req.closing is None:
            return
        log.warning("%s: %r not fenced after %s s (READs %s, no confirmation from %s, "
                    "Landed awaited for parts %s): its blocks are reported unsafe", self.name,
                    rid, self.config.abort_grace_s, sorted(req.reads), sorted(req.waiting_acks),
                    sorted(req.fence))
        for name in list(req.reads):
            self._abandon_read(rid, req, name)
        self._ask_abort(rid, req)  # a pull's producer may release its blocks now
        req.unsafe = True
        self._finish(rid, req.closing, req.error)

    def _finish(self, rid: str, state: RequestState, error: KvpushError | None) -> None:
        req = self._requests.pop(rid)
        self._posting.pop(rid, None)
        req.deadline.cancel()
        if req.grace is not None:
            req.grace.cancel()
        if req.handle.mode is TransferMode.PUSH:
            self._completions.remove(rid)
        LIVE.add("requests_pending", -1)
        self._report(req.handle, state, error, req.started, req.read_bytes, not req.unsafe,
                     ids=req.ids)

    def _report(self, handle: TransferHandle, state: RequestState, error: KvpushError | None,
                started: float, nbytes: int, safe: bool = True, *,
                ids: np.ndarray) -> None:
        counter = {
            RequestState.READY: "requests_completed",
            RequestState.FAILED: "requests_failed",
            RequestState.TIMED_OUT: "requests_timed_out",
            RequestState.ABORTED: "requests_aborted",
        }[state]
        setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        self._stats.results_unsafe += not safe
        result = TransferResult(handle.request_id, state, handle.mode, error,
                                time.monotonic() - started, nbytes, safe, ids, handle.xid)
        handle._set(result)
        if self._on_finished is None:
            queue_result(self._finished, result, self.name, "get_finished")
            return
        try:
            self._on_finished(result)
        except Exception:
            log.exception("%s: on_finished callback raised", self.name)

    # -- teardown --------------------------------------------------------------------------
    def _on_close(self) -> None:
        for peer in list(self._by_name.values()):
            self._tell(peer, m.Bye(self.name))
        for peer in list(self._producers.values()):
            for waiter in peer.waiters:
                waiter(None, ClosedError("consumer closed"))
            peer.waiters.clear()
        for rid, req in list(self._requests.items()):
            for name in list(req.reads):
                self._abandon_read(rid, req, name)
            # A push part that has not landed may still be written: its WRITE may be posted
            # though its Posted hint has not come (or never will: Bye ends nothing in
            # flight), so every such part, not only announced ones, leaves blocks unsafe.
            if req.handle.mode is TransferMode.PUSH:
                req.unsafe |= any(p not in req.settled
                                  for p in range(len(req.producers) * req.groups))
            self._finish(rid, RequestState.ABORTED, ClosedError("consumer closed"))
        self._by_name.clear()
        self._producers.clear()
