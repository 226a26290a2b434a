"""The decode side: connects to producers, registers destination blocks early (push) or
READs source blocks (pull), counts completions, and reports each request exactly once.

A result is reported only when the request's transfers have really ended, or says
``blocks_safe=False`` where that cannot be learnt: nothing is cancelled, since NIXL's
release of a transfer in progress does not stop its bytes (``docs/PROTOCOL.md``).

This module is the facade: the public methods validate on the engine's thread and hand
the call to its :class:`~kvpush.driver.Driver`, whose loop thread owns the NIXL agent and
the ZeroMQ sockets. Each producer connection -- handshake (layouts, authentication, Hello
retransmits), heartbeats, liveness, rejoin -- is a session of
:class:`kvpush.sessions.Dialing`. What happens to each request -- its states, which message
may change it, when it ends and how -- is decided by
:class:`kvpush.protocol.consumer.ConsumerCore`, which takes the loop's events and answers
with effects (:mod:`kvpush.protocol.effects`) that the driver carries out. The facade keeps
the configuration, the handles the engine waits on and the queue of results.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from . import _trace
from . import messages as m
from ._loop import no_blocking
from .agent import TransportConfig
from .aio import DrainQueue, drain_iter
from .auth import check_key
from .endpoint import Endpoint, check_durations, check_timeout, queue_result
from .errors import (
    AuthenticationError,
    ClosedError,
    InvalidBlockIds,
    KvpushError,
    PeerUnavailable,
    RequestAborted,
    TransferTimeout,
)
from .layout import KVLayout
from .plan import check_request_id, require_host_checksums, validate_block_ids
from .progress import ProgressPolicy
from .protocol.consumer import ConsumerCore, new_xid, pull_length_error
from .protocol.effects import ClaimGone
from .request import (
    ConnectHandle,
    ConnectResult,
    RequestState,
    RequestStatus,
    TransferHandle,
    TransferMode,
    TransferResult,
)
from .sessions import Dialing

__all__ = ["Consumer", "ConsumerConfig", "new_xid"]

log = logging.getLogger("kvpush.consumer")


def check_sharers(value: Any, what: str = "sharers") -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= m.MAX_SHARERS:
        raise ValueError(f"{what} must be an int in [1, {m.MAX_SHARERS}], got {value!r}")
    return value


def sharer_counts(sharers: int | Sequence[int], n: int, what: str) -> list[int]:
    """``sharers`` as one valid count for each of ``n`` producers or tickets (one count for
    all, or a sequence of ``n``)."""
    if isinstance(sharers, (list, tuple)):
        counts = [check_sharers(s, "each of sharers") for s in sharers]
        if len(counts) != n:
            raise ValueError(f"sharers names {len(counts)} counts for {n} {what}")
        return counts
    return [check_sharers(sharers)] * n


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
        A producer that has not answered a heartbeat this long after it was sent is declared
        gone; its requests fail. (Messages waiting unread are read first, so a stall of
        this side's own loop does not count as the producer's silence.)
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


class _Claim(NamedTuple):
    """A claim (``Consumer.claim`` / ``claim_push``) not continued yet, as the engine's
    threads see it: what a pull of the same tickets (an expect from the same producers)
    continues. Its state lives in the core, which tells when it is gone (ClaimGone)."""

    xid: int
    push: bool
    sids: dict[str, int]   # producer name -> sid (0: push)


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
        if config.verify:  # before anything is registered
            require_host_checksums(layout, "ConsumerConfig.verify")
        self.config = config
        self._on_finished = on_finished
        self._finished: DrainQueue[TransferResult] = DrainQueue()
        # called on the loop thread with every result (kvpush.prometheus)
        self._observers: list[Callable[[TransferResult], None]] = []
        # Every request's state lives in the core; this facade keeps only the handles the
        # engine waits on (by xid).
        self._handles: dict[int, TransferHandle] = {}
        # claims not continued yet, by request id, so that a pull or expect takes the
        # claim's xid and a second claim is refused on the caller's thread; written by the
        # engine's threads (claim, pull, expect, abort) and the loop (ClaimGone), hence the lock
        self._claims: dict[str, _Claim] = {}
        self._claims_lock = threading.Lock()
        # The sessions with producers: handshake, authentication, heartbeats, liveness,
        # one connection per producer (kvpush.protocol.session, the machine the simulator
        # runs too).
        self._core, self._sessions = self._assemble(
            layout, config,
            lambda d: ConsumerCore(layout, config, d.links, d.stats),
            lambda d, core: Dialing(d, core, peer_timeout_s=config.peer_timeout_s,
                                    heartbeat_s=config.heartbeat_s,
                                    connect_timeout_s=config.connect_timeout_s),
            self._deliver, self._finished.end)

    # -- engine API (any thread) -----------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> str:
        """Handshake with the producer at ``address`` (e.g. ``Producer.address``); returns
        its name. Idempotent. Raises :class:`~kvpush.errors.LayoutMismatch` when the layouts
        cannot exchange blocks and :class:`~kvpush.errors.PeerUnavailable` when the producer
        does not answer within ``timeout``. It blocks: calling it from a kvpush callback
        (on a loop thread) raises RuntimeError; :meth:`connect_nowait` does not block."""
        no_blocking("Consumer.connect()")
        timeout = self._connect_timeout(timeout)
        handle = self.connect_nowait(address, timeout)
        try:
            return handle.wait(timeout + 5.0)
        except TransferTimeout:
            raise PeerUnavailable(f"handshake with {address} did not finish in {timeout} s") \
                from None

    def connect_nowait(self, address: str, timeout: float | None = None) -> ConnectHandle:
        """Start the handshake with the producer at ``address`` and return at once (any
        thread, callbacks included). The :class:`~kvpush.request.ConnectHandle` resolves to
        the producer's name (``await handle``, ``handle.wait(t)``,
        ``handle.add_done_callback(fn)``) or to the error :meth:`connect` would raise, at
        the latest ``timeout`` (default ``connect_timeout_s``) after this call."""
        if not isinstance(address, str) or "://" not in address:
            raise ValueError(f"address must be a ZeroMQ endpoint like tcp://host:port, "
                             f"got {address!r}")
        timeout = self._connect_timeout(timeout)
        handle = ConnectHandle(address)

        def on_result(name: str | None, error: KvpushError | None) -> None:
            handle._set(ConnectResult(address, name, error))

        self._driver.call_soon(lambda: self._sessions.connect(address, timeout, on_result))
        return handle

    def _connect_timeout(self, timeout: float | None) -> float:
        return self.config.connect_timeout_s if timeout is None \
            else check_timeout(timeout, "connect timeout")

    def expect(self, request_id: str, block_ids: Any, producers: str | Sequence[str], *,
               timeout: float | None = None, layerwise: bool = False,
               source_tail: bool = False, sharers: int | Sequence[int] = 1,
               sids: Sequence[int] | None = None) -> TransferHandle:
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

        ``sids``: each producer's source use (the ``sid`` its engine named in
        ``Producer.prefill_done``), when the router relays it: the registration then attaches
        to that use only (docs/PROTOCOL.md, owners). Needed to reuse an id while a producer
        may still hold its previous use.

        The handle's ``xid`` (and its result's) names this use of ``request_id``."""
        handle, feed = self._prepare_expect(request_id, block_ids, producers, timeout,
                                            layerwise, source_tail, sharers, sids)
        self._driver.submit(feed)
        return handle

    def _prepare_expect(self, request_id: str, block_ids: Any,
                        producers: str | Sequence[str], timeout: float | None,
                        layerwise: bool, source_tail: bool, sharers: int | Sequence[int],
                        sids: Sequence[int] | None = None
                        ) -> tuple[TransferHandle, Callable[[float], None]]:
        """Validate an expect (caller's thread; raises on bad input) and make the event
        that registers it on the loop thread."""
        rid = self._check_request_id(request_id)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        names = [producers] if isinstance(producers, str) else list(producers)
        if not names:
            raise ValueError("expect needs at least one producer")
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"producers must be names (str), got {producers!r}")
        shares = sharer_counts(sharers, len(names), "producers")
        uses = None if sids is None else list(sids)
        if uses is not None and (len(uses) != len(names) or not all(
                isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 63
                for u in uses)):
            raise ValueError(f"sids: one int in [0, 2**63) per producer, got {sids!r}")
        seconds = self.config.request_timeout_s if timeout is None \
            else check_timeout(timeout, "expect timeout")
        groups = self.layout.num_layers if layerwise else 1
        with self._claims_lock:
            claim = self._claims.pop(rid, None)
        stale = None
        if claim is not None and (not claim.push or list(claim.sids) != names):
            stale, claim = claim, None  # claimed otherwise (a pull, other producers)
        handle = TransferHandle(rid, TransferMode.PUSH,
                                claim.xid if claim is not None else new_xid())

        def feed(now: float) -> None:
            if stale is not None:  # give the other claim up
                self._core.abort_claim(now, rid, stale.xid, "claim superseded")
            self._handles[handle.xid] = handle
            self._core.expect(now, rid, ids, names, seconds, groups, source_tail, shares,
                              handle.xid, uses)

        return handle, feed

    def expect_many(self, items: Sequence[tuple[str, Any, str | Sequence[str]]], *,
                    timeout: float | None = None, layerwise: bool = False,
                    source_tail: bool = False, sharers: int | Sequence[int] = 1
                    ) -> list[TransferHandle | Exception]:
        """:meth:`expect` for a batch: ``items`` are ``(request_id, block_ids, producers)``
        and the keyword options apply to each. Every item is validated on its own; the
        valid ones reach the loop thread in one hand-off, in order. Returns one entry per
        item: its :class:`~kvpush.request.TransferHandle`, or the exception a single
        ``expect`` of it would have raised (a bad item refuses only itself). Never blocks."""
        def prepare(item: Any) -> tuple[TransferHandle, Callable[[float], None]]:
            request_id, block_ids, producers = item
            return self._prepare_expect(request_id, block_ids, producers, timeout, layerwise,
                                        source_tail, sharers)

        return self._driver.batch(items, prepare)

    def pull_many(self, items: Sequence[tuple[m.PullTicket | bytes
                                              | Sequence[m.PullTicket | bytes], Any]], *,
                  timeout: float | None = None, source_tail: bool = False,
                  sharers: int | Sequence[int] = 1) -> list[TransferHandle | Exception]:
        """:meth:`pull` for a batch: ``items`` are ``(tickets, block_ids)`` and the keyword
        options apply to each; validated one by one, the valid ones handed to the loop
        thread at once, in order. Returns per item its handle or the exception a single
        ``pull`` would have raised. Never blocks (handshakes are part of each request)."""
        def prepare(item: Any) -> tuple[TransferHandle, Callable[[float], None]]:
            tickets, block_ids = item
            return self._prepare_pull(tickets, block_ids, timeout, source_tail, sharers)

        return self._driver.batch(items, prepare)

    def pull(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
             block_ids: Any, *, timeout: float | None = None,
             source_tail: bool = False,
             sharers: int | Sequence[int] = 1) -> TransferHandle:
        """Pull: READ the blocks named by a :class:`~kvpush.messages.PullTicket` (or by one
        ticket per producer rank, for the same request) into ``block_ids``. Returns at once
        (any thread, callbacks included): a ticket's producer not connected yet is connected
        to first, on the loop thread, as part of the request (``status().phase`` is
        ``connecting``; at most ``connect_timeout_s`` and never past the tickets' lease or
        ``timeout``); a handshake that fails ends the request FAILED with its error
        (``PeerUnavailable``, ``LayoutMismatch``, ...), nothing posted.

        ``source_tail``: read only the last ``len(block_ids)`` blocks of each ticket (see
        :meth:`expect`). ``sharers``: how many consumer endpoints read a share of each
        ticket's source (one count for all, or one per ticket; see :meth:`expect`).

        A pull of the tickets a :meth:`claim` named continues that claim (same ``xid``;
        the producer holds a claimed source past the ticket's lease, so only ``timeout``
        bounds the READ)."""
        handle, feed = self._prepare_pull(tickets, block_ids, timeout, source_tail, sharers)
        self._driver.submit(feed)
        return handle

    def _prepare_pull(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
                      block_ids: Any, timeout: float | None, source_tail: bool,
                      sharers: int | Sequence[int]
                      ) -> tuple[TransferHandle, Callable[[float], None]]:
        """Validate a pull (caller's thread; raises on bad input, nothing queued) and make
        the event that starts it on the loop thread."""
        started = time.monotonic()
        rid, parsed = self._parse_tickets(tickets, "pull")
        counts = sharer_counts(sharers, len(parsed), "tickets")
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
        seconds = self.config.request_timeout_s if timeout is None \
            else check_timeout(timeout, "pull timeout")
        deadline = started + seconds
        for t, src in zip(parsed, sources, strict=True):
            if self._sessions.up(t.producer):  # others are checked once connected
                error = pull_length_error(t, src, dst, self.layout,
                                          self._sessions.layout_of(t.producer))
                if error is not None:
                    raise error
        with self._claims_lock:
            claim = self._claims.pop(rid, None)
        stale = None
        if claim is not None and (claim.push or
                                  claim.sids != {t.producer: t.sid for t in parsed}):
            # Claimed from another source use (an earlier prefill of this id): give it up.
            stale, claim = claim, None
        claimed = claim is not None

        def budget() -> float:
            """Seconds left to the READ: the timeout, and (unless claimed: the producer
            holds a claimed source past the lease) every ticket's lease."""
            left = deadline - time.monotonic()
            return left if claimed else min(left, self._lease_left(parsed))

        handle = TransferHandle(rid, TransferMode.PULL,
                                claim.xid if claim is not None else new_xid())

        def feed(now: float) -> None:
            if stale is not None:
                self._core.abort_claim(now, rid, stale.xid, "claim superseded")
            self._handles[handle.xid] = handle
            self._core.pull(now, parsed, sources, dst, budget(), counts, handle.xid,
                            dial_s=self.config.connect_timeout_s)

        return handle, feed

    def claim(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
              sharers: int | Sequence[int] = 1) -> int:
        """Pull later: this consumer will READ the tickets' blocks but cannot yet (its
        engine has no free blocks). Asks each ticket's producer to hold its source past the
        ticket's lease while this consumer is connected (bounded by the producer's
        ``max_wait_s``). A later :meth:`pull` of the same tickets continues the claim (its
        ``xid``); :meth:`abort` of the request gives it up. Returns the xid at once (any
        thread, callbacks included).

        A ticket's producer not connected yet is connected to first, on the loop thread
        (``status().phase`` is ``claiming``; at most ``connect_timeout_s``, never past the
        tickets' lease). If a handshake fails, the claim is given up (logged): a later pull
        connects itself and ends with the handshake's error; a pull made during the
        handshake connects itself too, within the tickets' lease. Raises TransferTimeout
        if the tickets' lease has run out."""
        rid, parsed = self._parse_tickets(tickets, "claim")
        counts = sharer_counts(sharers, len(parsed), "tickets")
        if self._lease_left(parsed) <= 0:
            raise TransferTimeout(f"the pull ticket's lease for {rid!r} has run out")
        claim = _Claim(new_xid(), False, {t.producer: t.sid for t in parsed})
        return self._add_claim(rid, claim, lambda now: self._core.claim(
            now, parsed, counts, claim.xid, dial_s=self.config.connect_timeout_s,
            lease_s=self._lease_left(parsed)))

    def claim_push(self, request_id: str, producers: str | Sequence[str], *,
                   sharers: int | Sequence[int] = 1) -> int:
        """Push later: this consumer will :meth:`expect` ``request_id`` from ``producers``
        (names from :meth:`connect`) but has no blocks for it yet. Asks each producer to
        hold the request's source past its lease while this consumer is connected (bounded
        by the producer's ``max_wait_s``), whether its prefill is done yet or not. A later
        :meth:`expect` of the same request from the same producers continues the claim;
        :meth:`abort` gives it up, and so does this consumer's loss or close. Returns the
        claim's transfer id (the expect's ``xid``) at once."""
        rid = self._check_request_id(request_id)
        names = [producers] if isinstance(producers, str) else list(producers)
        if not names:
            raise ValueError("claim_push needs at least one producer")
        shares = sharer_counts(sharers, len(names), "producers")
        unknown = [n for n in names if not self._sessions.up(n)]
        if unknown:
            raise PeerUnavailable(f"not connected to {unknown} (connect first)")
        claim = _Claim(new_xid(), True, dict.fromkeys(names, 0))
        return self._add_claim(rid, claim, lambda now: self._core.claim_push(
            now, rid, names, shares, claim.xid))

    def _add_claim(self, rid: str, claim: _Claim, feed: Callable[[float], object]) -> int:
        """Record ``claim`` for ``rid`` (one per id) and queue ``feed``, which makes it in
        the core; a closed Consumer keeps no record. Returns the claim's xid."""
        with self._claims_lock:
            if rid in self._claims:
                raise InvalidBlockIds(f"request {rid!r} is already claimed")
            self._claims[rid] = claim
        try:
            self._driver.submit(feed)
        except ClosedError:
            self._claim_gone(ClaimGone(rid, claim.xid))
            raise
        return claim.xid

    def _claim_gone(self, gone: ClaimGone) -> None:
        """Forget claim ``gone`` (not a later claim of the same id)."""
        with self._claims_lock:
            claim = self._claims.get(gone.request_id)
            if claim is not None and claim.xid == gone.xid:
                del self._claims[gone.request_id]

    def abort(self, request_id: str, reason: str = "aborted by consumer") -> None:
        """Give up ``request_id``; its result (ABORTED) comes once the blocks are safe. A
        claim not continued yet is given up at its producers (no result: it has no
        handle)."""
        with self._claims_lock:
            claim = self._claims.pop(request_id, None)

        def feed(now: float) -> None:
            if claim is not None:
                self._core.abort_claim(now, request_id, claim.xid, reason)
            self._core.abort(now, request_id, RequestState.ABORTED, RequestAborted(reason))

        self._driver.submit(feed)

    def _parse_tickets(self, tickets: m.PullTicket | bytes | Sequence[m.PullTicket | bytes],
                       what: str) -> tuple[str, list[m.PullTicket]]:
        batch = [tickets] if isinstance(tickets, (m.PullTicket, bytes, bytearray)) \
            else list(tickets)
        parsed = [m.PullTicket.from_bytes(bytes(t)) if isinstance(t, (bytes, bytearray))
                  else t for t in batch]
        if not parsed:
            raise ValueError(f"{what} needs at least one ticket")
        key = self.config.auth_key
        if key is not None:  # a router can neither read nor alter a sealed ticket
            parsed = [t.open(key) for t in parsed]
        elif any(t.sealed for t in parsed):
            raise AuthenticationError("the pull ticket is sealed, but this consumer has no "
                                      "auth_key to open it")
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

    def get_finished(self) -> list[TransferResult]:
        """Results since the last call, oldest first (for engines that poll rather than take
        callbacks; without ``on_finished`` every result is queued here, whether or not its
        handle is also awaited). Never blocks; any thread."""
        return self._finished.take()

    def fileno(self) -> int:
        """A file descriptor (an eventfd) that is readable when :meth:`get_finished` may
        have results, and once the Consumer is closed: watch it with a selector, ``epoll``
        or ``loop.add_reader`` and drain when it fires (draining clears it). Only results
        queued without an ``on_finished`` callback wake it. Valid for this object's
        lifetime."""
        return self._finished.fileno()

    def results(self) -> AsyncIterator[TransferResult]:
        """``async for result in consumer.results()``: every result as it comes, in order,
        until the Consumer closes (stock asyncio loop or uvloop; it waits on
        :meth:`fileno`, no thread). The same queue as :meth:`get_finished`: use one of
        the two. Raises RuntimeError if the Consumer has an ``on_finished`` callback (then
        nothing is queued)."""
        if self._on_finished is not None:
            raise RuntimeError("Consumer.results(): this Consumer has an on_finished "
                               "callback, so no result is queued for an iterator")
        return drain_iter(self._finished)

    def status(self, request_id: str) -> RequestStatus:
        """A snapshot of ``request_id``'s live use here (:class:`~kvpush.RequestStatus`:
        phase, mode, xid, parts landed of parts owed, deadline, bytes so far); phase
        ``none`` once it has its result. Taken on the loop thread: the call waits for the
        loop briefly (at most 10 s), runs at once inside this Consumer's own callbacks, and
        raises RuntimeError inside another endpoint's (ClosedError once closed)."""
        rid = self._check_request_id(request_id)
        status: RequestStatus = self._driver.call_and_wait(
            lambda: self._core.snapshot(rid), 10.0, "Consumer.status()")
        return status

    def stats(self) -> dict[str, int]:
        """Counters of what this Consumer has done (:class:`kvpush.metrics.Stats`)."""
        return self._driver.stats.as_dict()

    @property
    def pending(self) -> int:
        """Requests with no result yet (handshakes of pulls included)."""
        return self._core.pending

    def producers(self) -> list[str]:
        """Names of producers connected now."""
        return list(self._sessions.machine.by_name)

    def producer_layout(self, name: str) -> KVLayout:
        """The KV layout a connected producer announced (e.g. its head shard, for
        :func:`kvpush.layout.covering_producers`)."""
        theirs = self._sessions.layout_of(name)
        if theirs is None:
            raise PeerUnavailable(f"not connected to {name!r}")
        return theirs

    @staticmethod
    def _check_request_id(request_id: Any) -> str:
        return check_request_id(request_id)

    # -- loop thread ---------------------------------------------------------------------
    def _deliver(self, result: Any) -> None:
        """Hand a result to the engine: the observers, its handle, then the callback or the
        queue. (A claim the core gave up only leaves the claims.)"""
        if isinstance(result, ClaimGone):
            self._claim_gone(result)
            return
        assert isinstance(result, TransferResult)
        if _trace.ON:
            _trace.stamp("result")
        handle = self._handles.pop(result.xid, None)
        for observe in self._observers:
            try:
                observe(result)
            except Exception:
                log.exception("%s: a result observer raised", self.name)
        if handle is not None:
            handle._set(result)
        if self._on_finished is None:
            queue_result(self._finished, result, self.name, "get_finished")
            self._finished.signal()
            return
        try:
            self._on_finished(result)
        except Exception:
            log.exception("%s: on_finished callback raised", self.name)
