"""The decode side: connects to producers, registers destination blocks early (push) or
READs source blocks (pull), and reports each request exactly once.

A result is reported only once the request's transfers have really ended, or says
``blocks_safe=False`` where that cannot be learnt: NIXL's release of a transfer in progress
does not stop its bytes (``docs/PROTOCOL.md``).

This module is the facade: the public methods validate on the engine's thread and hand
the call to a :class:`~kvpush.driver.Driver`, whose loop thread owns the NIXL agent and the
sockets. Each producer connection is a session of :class:`kvpush.sessions.Dialing`; each
request -- its phases (claims and handshakes included), which message may change it, how
it ends -- is :class:`kvpush.protocol.consumer.ConsumerCore`'s. The facade keeps the
configuration, the handles the engine waits on, the queue of results, and the xid of each
claim not continued yet (what the engine's thread must answer at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import _trace
from ._loop import no_blocking
from .agent import TransportConfig
from .aio import DrainQueue, drain_iter
from .auth import check_key
from .endpoint import Endpoint, check_durations, check_timeout, queue_result, sharer_counts
from .errors import (
    ClosedError,
    InvalidRequest,
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
from .tickets import Tickets, lease_left, parse_tickets, source_ids

__all__ = ["Consumer", "ConsumerConfig", "new_xid"]

log = logging.getLogger("kvpush.consumer")

Feed = Callable[[float], None]


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
        A producer that has not answered a heartbeat this long after it was sent is gone;
        its requests fail. (Messages waiting unread are read first: a stall of this side's
        loop is not the producer's silence.)
    abort_grace_s
        After an abort, timeout or failure, how long to wait for the request's transfers to
        end before reporting it with ``blocks_safe=False``.
    lease_margin_s
        Pull: a READ is started only if the ticket's lease has at least this long left.
    verify
        Check every received block against the producer's per-block checksums (push: asked
        for in the registration; pull: the ticket must carry them, ``ProducerConfig.verify``);
        a mismatch fails the request. Requests with several producer parts are not verified
        (each part holds only a share of a block).
    auth_key
        Shared key (bytes, >= 16) authenticating every control message and notification
        (:mod:`kvpush.auth`); must equal the producers'. None: no authentication.
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
    """A claim not continued yet, as the engine's threads see it (its state is the
    core's): the xid a pull of the same tickets, or an expect from the same producers,
    continues."""

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
        self._handles: dict[int, TransferHandle] = {}   # by xid, until the result
        # Claims not continued yet, by request id: written by the engine's threads (claim,
        # pull, expect, abort) and the loop (the core's ClaimGone), hence the lock.
        self._claims: dict[str, _Claim] = {}
        self._claims_lock = threading.Lock()
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
        with each producer (a name from :meth:`connect`; one per rank that owes data).
        Returns at once; the handle reports the result. Its ``xid`` (and its result's) names
        this use of ``request_id``; an expect from the producers a :meth:`claim_push` named
        continues that claim (its xid).

        ``layerwise``: each producer writes every layer once it is final
        (``Producer.layer_done``); READY once every layer of every producer has landed.

        ``source_tail``: ``block_ids`` receive only the *last* ``len(block_ids)`` of the
        producer's source blocks (this side holds the earlier ones: a prefix-cache hit);
        without it the two counts must match.

        ``sharers``: how many consumer endpoints take a share of each producer's source
        (heterogeneous TP: each decode rank is written its head share); one int for every
        producer, or one per producer. The producer holds its source until that many have
        finished or given up.

        ``sids``: each producer's source use (the ``sid`` of ``Producer.prefill_done``),
        when the router relays it: the registration attaches to that use only
        (docs/PROTOCOL.md, owners), so an id can be reused while a producer may still hold
        its previous use."""
        handle, feed = self._prepare_expect(request_id, block_ids, producers, timeout,
                                            layerwise, source_tail, sharers, sids)
        self._driver.submit(feed, opens=True)
        return handle

    def _prepare_expect(self, request_id: str, block_ids: Any,
                        producers: str | Sequence[str], timeout: float | None,
                        layerwise: bool, source_tail: bool, sharers: int | Sequence[int],
                        sids: Sequence[int] | None = None) -> tuple[TransferHandle, Feed]:
        """Validate an expect (caller's thread; raises on bad input) and make the event
        that registers it on the loop thread."""
        rid = check_request_id(request_id)
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
        xid, stale = self._take_claim(rid, _Claim(0, True, dict.fromkeys(names, 0)))
        handle = TransferHandle(rid, TransferMode.PUSH, xid or new_xid())

        def feed(now: float) -> None:
            if stale:
                self._core.abort_claim(now, rid, stale, "claim superseded")
            self._handles[handle.xid] = handle
            self._core.expect(now, rid, ids, names, seconds, groups, source_tail, shares,
                              handle.xid, uses)

        return handle, feed

    def expect_many(self, items: Sequence[tuple[str, Any, str | Sequence[str]]], *,
                    timeout: float | None = None, layerwise: bool = False,
                    source_tail: bool = False, sharers: int | Sequence[int] = 1
                    ) -> list[TransferHandle | Exception]:
        """:meth:`expect` for a batch: ``items`` are ``(request_id, block_ids, producers)``,
        the keyword options apply to each. Each item is validated on its own and the valid
        ones reach the loop thread in one hand-off, in order. Returns per item its
        :class:`~kvpush.request.TransferHandle` or the exception a single ``expect`` would
        have raised (a bad item refuses only itself). Never blocks."""
        def prepare(item: Any) -> tuple[TransferHandle, Feed]:
            request_id, block_ids, producers = item
            return self._prepare_expect(request_id, block_ids, producers, timeout, layerwise,
                                        source_tail, sharers)

        return self._driver.batch(items, prepare)

    def pull_many(self, items: Sequence[tuple[Tickets, Any]], *,
                  timeout: float | None = None, source_tail: bool = False,
                  sharers: int | Sequence[int] = 1) -> list[TransferHandle | Exception]:
        """:meth:`pull` for a batch: ``items`` are ``(tickets, block_ids)``, the keyword
        options apply to each; as :meth:`expect_many`. Never blocks (handshakes are part
        of each request)."""
        def prepare(item: Any) -> tuple[TransferHandle, Feed]:
            tickets, block_ids = item
            return self._prepare_pull(tickets, block_ids, timeout, source_tail, sharers)

        return self._driver.batch(items, prepare)

    def pull(self, tickets: Tickets, block_ids: Any, *, timeout: float | None = None,
             source_tail: bool = False, sharers: int | Sequence[int] = 1) -> TransferHandle:
        """Pull: READ the blocks named by a :class:`~kvpush.messages.PullTicket` (or by one
        ticket per producer rank of the request) into ``block_ids``. Returns at once (any
        thread, callbacks included): a ticket's producer not connected yet is connected to
        first, on the loop thread, as part of the request (``status().phase`` is
        ``connecting``; at most ``connect_timeout_s``, never past the tickets' lease or
        ``timeout``); a handshake that fails ends the request FAILED with its error
        (``PeerUnavailable``, ``LayoutMismatch``, ...), nothing posted.

        ``source_tail``: read only the last ``len(block_ids)`` blocks of each ticket;
        ``sharers``: one count for all tickets or one per ticket (see :meth:`expect`).

        A pull of the tickets a :meth:`claim` named continues that claim (same ``xid``;
        the producer holds a claimed source past the lease, so only ``timeout`` bounds the
        READ)."""
        handle, feed = self._prepare_pull(tickets, block_ids, timeout, source_tail, sharers)
        self._driver.submit(feed, opens=True)
        return handle

    def _prepare_pull(self, tickets: Tickets, block_ids: Any, timeout: float | None,
                      source_tail: bool, sharers: int | Sequence[int]
                      ) -> tuple[TransferHandle, Feed]:
        """Validate a pull (caller's thread; raises on bad input, nothing queued) and make
        the event that starts it on the loop thread."""
        started = time.monotonic()
        rid, parsed = parse_tickets(tickets, "pull", self.config.auth_key)
        counts = sharer_counts(sharers, len(parsed), "tickets")
        dst = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        parsed, sources = source_ids(parsed, dst, source_tail)
        deadline = started + (self.config.request_timeout_s if timeout is None
                              else check_timeout(timeout, "pull timeout"))
        for t, src in zip(parsed, sources, strict=True):
            if self._sessions.up(t.producer):  # others are checked once connected
                error = pull_length_error(t, src, dst, self.layout,
                                          self._sessions.layout_of(t.producer))
                if error is not None:
                    raise error
        xid, stale = self._take_claim(rid, _Claim(0, False, {t.producer: t.sid for t in parsed}))
        margin = self.config.lease_margin_s

        def budget() -> float:
            """Seconds left to the READ: the timeout, and (unless claimed: the producer
            holds a claimed source past the lease) every ticket's lease."""
            left = deadline - time.monotonic()
            return left if xid else min(left, lease_left(parsed, margin))

        handle = TransferHandle(rid, TransferMode.PULL, xid or new_xid())

        def feed(now: float) -> None:
            if stale:
                self._core.abort_claim(now, rid, stale, "claim superseded")
            self._handles[handle.xid] = handle
            self._core.pull(now, parsed, sources, dst, budget(), counts, handle.xid,
                            dial_s=self.config.connect_timeout_s)

        return handle, feed

    def claim(self, tickets: Tickets, sharers: int | Sequence[int] = 1) -> int:
        """Pull later: this consumer will READ the tickets' blocks but cannot yet (no free
        blocks). Asks each ticket's producer to hold its source past the ticket's lease
        while this consumer is connected (bounded by the producer's ``max_wait_s``). A
        later :meth:`pull` of the same tickets continues the claim (its ``xid``);
        :meth:`abort` gives it up. Returns the xid at once (any thread, callbacks included).

        A producer not connected yet is connected to first, on the loop thread
        (``status().phase`` is ``claiming``; at most ``connect_timeout_s``, never past the
        tickets' lease). A claim whose handshake fails, or that its producer refuses or
        loses, is given up (logged; it has no result): a later pull starts anew, and meets
        the handshake's error itself. A pull made during the handshake connects itself,
        within the lease. Raises TransferTimeout if the tickets' lease has run out."""
        rid, parsed = parse_tickets(tickets, "claim", self.config.auth_key)
        counts = sharer_counts(sharers, len(parsed), "tickets")
        margin = self.config.lease_margin_s
        if lease_left(parsed, margin) <= 0:
            raise TransferTimeout(f"the pull ticket's lease for {rid!r} has run out")
        claim = _Claim(new_xid(), False, {t.producer: t.sid for t in parsed})
        return self._add_claim(rid, claim, lambda now: self._core.claim(
            now, parsed, counts, claim.xid, dial_s=self.config.connect_timeout_s,
            lease_s=lease_left(parsed, margin)))

    def claim_push(self, request_id: str, producers: str | Sequence[str], *,
                   sharers: int | Sequence[int] = 1) -> int:
        """Push later: this consumer will :meth:`expect` ``request_id`` from ``producers``
        (names from :meth:`connect`) but has no blocks for it yet. Asks each producer to
        hold the request's source past its lease while this consumer is connected (bounded
        by the producer's ``max_wait_s``), whether its prefill is done yet or not. An
        :meth:`expect` from the same producers continues the claim; :meth:`abort` gives it
        up, and so does this consumer's loss or close. Returns the xid at once."""
        rid = check_request_id(request_id)
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
        """Record ``claim`` (one per id) and queue ``feed``, which makes it in the core;
        a closed Consumer keeps no record."""
        with self._claims_lock:
            if rid in self._claims:
                raise InvalidRequest(f"request {rid!r} is already claimed")
            self._claims[rid] = claim
        try:
            self._driver.submit(feed)
        except ClosedError:
            self._claim_gone(ClaimGone(rid, claim.xid))
            raise
        return claim.xid

    def _take_claim(self, rid: str, use: _Claim) -> tuple[int, int]:
        """The xid of ``rid``'s claim that ``use`` (a pull, an expect) continues, and of one
        it supersedes (claimed from other producers or another source use); 0: none."""
        with self._claims_lock:
            claim = self._claims.pop(rid, None)
        if claim is None:
            return 0, 0
        if (claim.push, claim.sids) != (use.push, use.sids):
            return 0, claim.xid
        return claim.xid, 0

    def _claim_gone(self, gone: ClaimGone) -> None:
        with self._claims_lock:
            claim = self._claims.get(gone.request_id)
            if claim is not None and claim.xid == gone.xid:  # not a later claim of the id
                del self._claims[gone.request_id]

    def abort(self, request_id: str, reason: str = "aborted by consumer") -> None:
        """Give up ``request_id``; its result (ABORTED) comes once the blocks are safe. A
        claim not continued yet is given up at its producers (no result: no handle)."""
        with self._claims_lock:
            claim = self._claims.pop(request_id, None)

        def feed(now: float) -> None:
            if claim is not None:
                self._core.abort_claim(now, request_id, claim.xid, reason)
            self._core.abort(now, request_id, RequestState.ABORTED, RequestAborted(reason))

        self._driver.submit(feed)

    def get_finished(self) -> list[TransferResult]:
        """Results since the last call, oldest first (for engines that poll; without
        ``on_finished`` every result is queued here, whether or not its handle is also
        awaited). Never blocks; any thread."""
        return self._finished.take()

    def fileno(self) -> int:
        """An eventfd, readable when :meth:`get_finished` may have results and once the
        Consumer is closed: watch it with a selector, ``epoll`` or ``loop.add_reader`` and
        drain when it fires (draining clears it). Only results queued without an
        ``on_finished`` callback wake it. Valid for this object's lifetime."""
        return self._finished.fileno()

    def results(self) -> AsyncIterator[TransferResult]:
        """``async for result in consumer.results()``: every result in order until the
        Consumer closes (stock asyncio or uvloop; it waits on :meth:`fileno`, no thread).
        The same queue as :meth:`get_finished`: use one of the two. Raises RuntimeError
        if the Consumer has an ``on_finished`` callback (then nothing is queued)."""
        if self._on_finished is not None:
            raise RuntimeError("Consumer.results(): this Consumer has an on_finished "
                               "callback, so no result is queued for an iterator")
        return drain_iter(self._finished)

    def status(self, request_id: str) -> RequestStatus:
        """A snapshot of ``request_id``'s live use or claim here
        (:class:`~kvpush.RequestStatus`: phase, mode, xid, parts landed of parts owed,
        deadline, bytes so far); phase ``none`` once it has its result. Taken on the loop
        thread: it waits for the loop briefly (at most 10 s), runs at once inside this
        Consumer's own callbacks, and raises RuntimeError inside another endpoint's
        (ClosedError once closed)."""
        rid = check_request_id(request_id)
        status: RequestStatus = self._driver.call_and_wait(
            lambda: self._core.snapshot(rid), 10.0, "Consumer.status()")
        return status

    def stats(self) -> dict[str, int]:
        """Counters of what this Consumer has done (:class:`kvpush.metrics.Stats`)."""
        return self._driver.stats.as_dict()

    @property
    def pending(self) -> int:
        """Requests with no result yet (handshakes of pulls included), from the caller's
        view: one whose ``expect`` or ``pull`` has returned counts at once."""
        return self._driver.pending(lambda: self._core.pending)

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
