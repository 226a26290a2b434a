"""The prefill side: serves handshakes, holds finished blocks, WRITEs them (push) or lets
the consumer READ them (pull), and hands the blocks back to the engine exactly once.

This module is the facade: it validates the engine's calls on the caller's thread and
hands them to its :class:`~kvpush.driver.Driver`, which owns the NIXL agent and the loop
thread, feeds every event to the protocol core (:class:`kvpush.protocol.producer.ProducerCore`,
where each request's state machine lives) and carries out the effects the core returns;
the sessions with consumers are :class:`kvpush.sessions.Accepting`. The facade keeps the
configuration and the queue of releases.

Push rendezvous: of the consumer's registration and the engine's ``prefill_done``, whichever
comes second triggers the WRITE at once, on the loop thread. The protocol, step by step and
on each failure: ``docs/PROTOCOL.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _trace
from . import messages as m
from .agent import TransportConfig
from .aio import DrainQueue, drain_iter
from .auth import check_key
from .endpoint import Endpoint, check_durations, queue_result
from .layout import KVLayout
from .messages import new_id
from .plan import block_checksums, check_request_id, require_host_checksums, validate_block_ids
from .progress import ProgressPolicy
from .protocol.producer import ProducerCore
from .request import Release, RequestStatus, TransferMode
from .sessions import Accepting

__all__ = ["Producer", "ProducerConfig"]

log = logging.getLogger("kvpush.producer")


@dataclass(frozen=True)
class ProducerConfig:
    """Producer settings (all durations in seconds).

    Parameters
    ----------
    host, port
        Where the control socket listens (port 0: any free port; see ``Producer.address``).
    advertise
        The host consumers dial, when it is not ``host`` (a wildcard bind such as
        ``0.0.0.0``, or NAT): ``Producer.address`` and pull tickets name it.
    lease_s
        How long finished source blocks wait for a registration (push) or for the consumer's
        READ (pull) before they are released with ``LEASE_EXPIRED``.
    max_wait_s
        Cap on how long a registration may wait for prefill (the consumer asks for its own).
    transfer_timeout_s
        A WRITE still in progress this long after its post is abandoned and the request
        failed; the consumer is told the WRITE is unfenced (``blocks_safe=False``). Aborts
        do not cut a WRITE short: it is left to finish, so the consumer knows when nothing
        more lands.
    peer_timeout_s
        A consumer silent for this long (no heartbeat) is considered gone (what it sent
        while this side's loop was stalled is read before that is judged).
    tombstone_s
        How long aborted or expired request ids are remembered, so a late registration
        fails fast instead of waiting.
    coalesce
        Merge runs of blocks adjacent on both sides into one descriptor (off only to measure).
    verify
        Put per-block source checksums in pull tickets (push sends them whenever the
        consumer asks), so a consumer can check every block it received.
    auth_key
        Shared key (bytes, >= 16) to authenticate every control message and notification
        (see :mod:`kvpush.auth`); None: no authentication. Consumers must use the same key.
    """

    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    name: str | None = None
    lease_s: float = 60.0
    max_wait_s: float = 600.0
    transfer_timeout_s: float = 30.0
    peer_timeout_s: float = 20.0
    tombstone_s: float = 120.0
    coalesce: bool = True
    verify: bool = False
    auth_key: bytes | None = field(default=None, repr=False)
    transport: TransportConfig = field(default_factory=TransportConfig)
    progress: ProgressPolicy = field(default_factory=ProgressPolicy)

    def __post_init__(self) -> None:
        check_key(self.auth_key, "ProducerConfig")
        check_durations(self, "lease_s", "max_wait_s", "transfer_timeout_s", "peer_timeout_s",
                        "tombstone_s")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ProducerConfig.port must be in [0, 65535], got {self.port}")


def _use(sid: int | None) -> int:
    """An engine's name for a use of a request id, checked: 0 when it names none."""
    if sid is None:
        return 0
    if isinstance(sid, bool) or not isinstance(sid, int) or not 0 < sid < 1 << 63:
        raise ValueError(f"sid must be an int in [1, 2**63), got {sid!r}")
    return sid


class Producer(Endpoint):
    """The prefill side of kvpush.

    Parameters
    ----------
    layout
        This side's KV cache (registered with NIXL for the Producer's lifetime).
    config
        :class:`ProducerConfig`.
    on_release
        Called on the Producer's loop thread with each :class:`~kvpush.request.Release`
        (keep it short; or leave it None and drain :meth:`get_released`).
    """

    _role = "producer"

    def __init__(self, layout: KVLayout, config: ProducerConfig | None = None, *,
                 on_release: Callable[[Release], None] | None = None) -> None:
        config = config or ProducerConfig()
        if config.verify:  # before anything is registered
            require_host_checksums(layout, "ProducerConfig.verify")
        self.config = config
        self._on_release = on_release
        self._released: DrainQueue[Release] = DrainQueue()
        # called on the loop thread with every release (kvpush.prometheus)
        self._observers: list[Callable[[Release], None]] = []
        # The sessions with consumers: handshake, authentication, liveness, incarnations
        # (kvpush.protocol.session, the machine the simulator runs too).
        self._core, self._sessions = self._assemble(
            layout, config,
            lambda d: ProducerCore(layout, config, d.links, d.stats),
            lambda d, core: Accepting(d, core, host=config.host, port=config.port,
                                      advertise=config.advertise,
                                      peer_timeout_s=config.peer_timeout_s),
            self._deliver, self._released.end)
        self.bound: str = self._sessions.bound
        self.address: str = self._sessions.address

    # -- engine API (any thread) -----------------------------------------------------------
    def prefill_done(self, request_id: str, block_ids: Any,
                     mode: TransferMode = TransferMode.PUSH, *,
                     sid: int | None = None) -> m.PullTicket | None:
        """Prefill for ``request_id`` is done; its KV is in ``block_ids`` (int32/int64 array).

        PUSH: the WRITE starts as soon as the consumer's registration is here (at once if it
        already is). PULL: returns the :class:`~kvpush.messages.PullTicket` the router relays
        to the consumer(s). Either way the blocks are held until released, exactly once
        (see :meth:`get_released`). Never blocks on transfer setup.

        ``sid`` names this use of the request id (it travels in pull tickets; a READ of
        another use's ticket is refused). Leave it None for a fresh random one; an engine
        that writes its tickets elsewhere (vLLM's scheduler process) passes the one it put
        there (:func:`new_id`).
        """
        ticket, feed = self._prepare_prefill(request_id, block_ids, mode, sid)
        self._driver.submit(feed, opens=True)
        return ticket

    def _prepare_prefill(self, request_id: str, block_ids: Any, mode: TransferMode,
                         sid: int | None
                         ) -> tuple[m.PullTicket | None, Callable[[float], None]]:
        """Validate a prefill_done (caller's thread; raises on bad input) and make its
        ticket (pull) and the event that holds the blocks on the loop thread."""
        called = time.monotonic()
        check_request_id(request_id)
        mode = TransferMode(mode)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        named = _use(sid)
        sid = named or new_id()
        # An unnamed push use goes to the core as sid 0: it tells this use's late calls
        # from a new use's by their blocks (a pull's sid is in its ticket: named).
        use = sid if named or mode is TransferMode.PULL else 0

        def feed(now: float) -> None:
            self._core.prefill_done(now, request_id, ids, mode, use, called)

        if mode is TransferMode.PULL:
            sums = block_checksums(self.layout, ids).astype("<u8").tobytes() \
                if self.config.verify else b""
            ticket = m.PullTicket(producer=self.name, address=self.address,
                                  request_id=request_id, block_ids=m.encode_ids(ids),
                                  lease_s=self.config.lease_s, issued_at=time.time(), sid=sid,
                                  checksums=sums)
            key = self.config.auth_key
            return (ticket if key is None else ticket.seal(key)), feed
        return None, feed

    def prefill_done_many(self, items: Sequence[tuple[str, Any] | tuple[str, Any, TransferMode]],
                          mode: TransferMode = TransferMode.PUSH
                          ) -> list[m.PullTicket | Exception | None]:
        """:meth:`prefill_done` for a batch: ``items`` are ``(request_id, block_ids)`` or
        ``(request_id, block_ids, mode)`` (``mode`` is the default of the former). Every
        item is validated on its own; the valid ones reach the loop thread in one
        hand-off, in order. Returns per item what a single call would: its pull ticket,
        None (push), or the exception a single call would have raised (that item's blocks
        are not held: the engine keeps them). Never blocks."""
        def prepare(item: Any) -> tuple[m.PullTicket | None, Callable[[float], None]]:
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise ValueError(f"each item is (request_id, block_ids[, mode]), got "
                                 f"{item!r:.80}")
            return self._prepare_prefill(item[0], item[1],
                                         item[2] if len(item) == 3 else mode, None)

        return self._driver.batch(items, prepare)

    def layer_done(self, request_id: str, block_ids: Any, layer: int, *,
                   sid: int | None = None) -> None:
        """Layer-wise push: layer ``layer``'s KV for ``request_id`` is final in
        ``block_ids``. A consumer that registered layer by layer (``expect(...,
        layerwise=True)``) gets that layer written at once, while later layers compute.
        Call it for layers as they finish, then :meth:`prefill_done` with the same blocks as
        usual (which also covers any layer not reported). Whole-request registrations just
        wait for ``prefill_done``. The lease starts at ``prefill_done``.

        ``sid`` names the use, as in :meth:`prefill_done` (pass the same to both); an
        unnamed use is told from a later use of the id by its blocks."""
        check_request_id(request_id)
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer!r}")
        if self.layout.layers_per_region != 1:
            raise ValueError("layer_done needs one layer per region (layers_per_region == 1)")
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        use = _use(sid)
        self._driver.submit(lambda now: self._core.layer_done(now, request_id, ids, layer,
                                                               use))

    def abort(self, request_id: str, reason: str = "aborted by producer", *,
              sid: int | None = None) -> None:
        """Give up ``request_id``'s live use wherever it is: its owners are told, and its
        blocks are released ``ABORTED`` once no transfer can read them (a WRITE in flight
        is left to end: NIXL cannot stop its bytes). An id with no use here yet: its next
        ``prefill_done`` (within ``tombstone_s``) is released ``ABORTED`` at once.

        ``sid`` names the use, as in :meth:`prefill_done` (the same one passed there, or a
        pull ticket's ``sid``). An engine that reuses request ids should name it: an
        unnamed abort that reaches this side after its use ended aborts the next use of
        the id. A named one aborts that use only: the live one if it is that use; else,
        unless that use already ended here, the use when it comes (its ``prefill_done``
        or first ``layer_done`` within ``tombstone_s``); otherwise nothing. A use whose
        ``prefill_done`` named no sid is never the one a named abort means."""
        check_request_id(request_id)
        use = _use(sid)
        self._driver.submit(lambda now: self._core.abort(now, request_id, reason, use))

    def get_released(self) -> list[Release]:
        """Releases since the last call, oldest first (for engines that poll rather than
        take callbacks). Never blocks; any thread."""
        return self._released.take()

    def fileno(self) -> int:
        """A file descriptor (an eventfd) that is readable when :meth:`get_released` may
        have releases, and once the Producer is closed: watch it with a selector, ``epoll``
        or ``loop.add_reader`` and drain when it fires (draining clears it). Only releases
        queued without an ``on_release`` callback wake it. Valid for this object's
        lifetime."""
        return self._released.fileno()

    def releases(self) -> AsyncIterator[Release]:
        """``async for release in producer.releases()``: every release as it comes, in
        order, until the Producer closes (stock asyncio loop or uvloop; it waits on
        :meth:`fileno`, no thread). The same queue as :meth:`get_released`: use one of the
        two. Raises RuntimeError if the Producer has an ``on_release`` callback."""
        if self._on_release is not None:
            raise RuntimeError("Producer.releases(): this Producer has an on_release "
                               "callback, so no release is queued for an iterator")
        return drain_iter(self._released)

    def status(self, request_id: str) -> RequestStatus:
        """A snapshot of ``request_id`` here (:class:`~kvpush.RequestStatus`: phase, mode,
        sid, source blocks, each owner's xid and state, owners done, lease deadline).
        Taken on the loop thread: waits for the loop briefly (at most 10 s), runs at once
        inside this Producer's own callbacks, raises RuntimeError inside another
        endpoint's (ClosedError once closed)."""
        check_request_id(request_id)
        status: RequestStatus = self._driver.call_and_wait(
            lambda: self._core.snapshot(request_id), 10.0, "Producer.status()")
        return status

    def stats(self) -> dict[str, int]:
        """Counters of what this Producer has done (:class:`kvpush.metrics.Stats`)."""
        return self._driver.stats.as_dict()

    @property
    def pending(self) -> int:
        """Requests whose source blocks are held (not yet released), from the caller's
        view: one whose ``prefill_done`` has returned counts at once."""
        return self._driver.pending(self._core.held)

    # -- loop thread ------------------------------------------------------------------------
    def _deliver(self, release: Any) -> None:
        """Hand a release to the engine: the observers, then the callback or the queue."""
        assert isinstance(release, Release)
        if _trace.ON:
            _trace.stamp("release")
        for observe in self._observers:
            try:
                observe(release)
            except Exception:
                log.exception("%s: a release observer raised", self.name)
        if self._on_release is None:
            queue_result(self._released, release, self.name, "get_released")
            self._released.signal()
            return
        try:
            self._on_release(release)
        except Exception:
            log.exception("%s: on_release callback raised", self.name)

    def _debug_state(self, rid: str) -> str:
        """Where ``rid`` is (loop thread; for tests): writing, registered, held-push,
        held-pull, pulling, ending, partial or none."""
        return self._core.debug_state(rid)
