"""The prefill side: serves handshakes, holds finished blocks, WRITEs them (push) or lets
the consumer READ them (pull), and hands the blocks back to the engine exactly once.

This module is the facade and the I/O driver: it validates the engine's calls on the
caller's thread, owns the control socket, the handshake and the NIXL agent on its loop
thread, feeds every event to the protocol core (:class:`kvpush.protocol.producer.ProducerCore`,
where each request's state machine lives) and carries out the effects the core returns.

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

import numpy as np
import zmq

from . import _trace
from . import messages as m
from .agent import TransportConfig
from .aio import DrainQueue, drain_iter
from .auth import Opener, Sealer, check_key
from .endpoint import (
    STRANGER_BYTES,
    STRANGER_FRAME_BYTES,
    STRANGER_PEER_BYTES,
    Endpoint,
    check_durations,
    control_socket,
    queue_result,
)
from .errors import KvpushError, PeerUnavailable
from .layout import KVLayout
from .messages import new_id
from .metrics import LIVE
from .plan import block_checksums, check_request_id, require_host_checksums, validate_block_ids
from .progress import ProgressPolicy
from .protocol.effects import Emit
from .protocol.producer import CoreConfig, ProducerCore
from .protocol.session import (
    AcceptConfig,
    Accepted,
    Acceptor,
    Admit,
    PeerDown,
    PeerUp,
    SessionEffect,
    Transmit,
)
from .request import Release, RequestStatus, TransferMode

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


class _Links:
    """The core's view of the agent's prepared descriptor lists."""

    def __init__(self, producer: Producer) -> None:
        self._p = producer

    def plan(self, peer: str, src: np.ndarray, dst: np.ndarray, coalesce: bool) -> Any:
        lay = self._p.layout
        return self._p._agent.link(peer).plan(src, dst, lay.num_blocks, lay.num_regions,
                                              coalesce)

    def desc_bytes(self, peer: str) -> int:
        return self._p._agent.link(peer).desc_bytes

    def checksums(self, ids: np.ndarray) -> bytes:
        return bytes(block_checksums(self._p.layout, ids).astype("<u8").tobytes())


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
        super().__init__(layout, name=config.name, transport=config.transport,
                         progress=config.progress, auth_key=config.auth_key)
        self.config = config
        self._on_release = on_release
        self._released: DrainQueue[Release] = DrainQueue()
        # called on the loop thread with every release (kvpush.prometheus)
        self._observers: list[Callable[[Release], None]] = []
        self._core: ProducerCore = ProducerCore(layout, CoreConfig(
            lease_s=config.lease_s, max_wait_s=config.max_wait_s,
            transfer_timeout_s=config.transfer_timeout_s, tombstone_s=config.tombstone_s,
            coalesce=config.coalesce, peer_timeout_s=config.peer_timeout_s), _Links(self))
        self._gauges = dict.fromkeys(self._core.gauges, 0)
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            control_socket(self._router, self.config.peer_timeout_s)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # A frame for a consumer that is not connected right now raises (and waits in
            # the outbox for its reconnection) instead of vanishing.
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if config.port:
                self._router.bind(f"tcp://{config.host}:{config.port}")
            else:
                self._router.bind(f"tcp://{config.host}:*")
            self.bound: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.address: str = self.bound if config.advertise is None else \
                f"tcp://{config.advertise}:{self.bound.rsplit(':', 1)[1]}"
        except zmq.ZMQError as exc:
            self._finalized = False
            self.close()
            raise PeerUnavailable(
                f"cannot listen on {config.host}:{config.port}: {exc}") from exc
        # The sessions with consumers: handshake, authentication, liveness, incarnations
        # (kvpush.protocol.session, the machine the simulator runs too).
        self._sessions = Acceptor(AcceptConfig(
            self.name, layout, config.auth_key, config.peer_timeout_s, self.address,
            self.bound, wire=lambda: self._agent.layout), self._agent.metadata, self._stats)
        self._add_socket(self._router, self._on_router)
        self._after(self.config.peer_timeout_s / 4, self._check_peers)
        self._finalized = False
        self._start()

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
        ticket, run = self._prepare_prefill(request_id, block_ids, mode, sid)
        self._call_soon(run)
        return ticket

    def _prepare_prefill(self, request_id: str, block_ids: Any, mode: TransferMode,
                         sid: int | None) -> tuple[m.PullTicket | None, Callable[[], None]]:
        """Validate a prefill_done (caller's thread; raises on bad input) and make its
        ticket (pull) and the closure that holds the blocks on the loop thread."""
        called = time.monotonic()
        check_request_id(request_id)
        mode = TransferMode(mode)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        named = sid is not None
        if sid is None:
            sid = new_id()
        elif isinstance(sid, bool) or not isinstance(sid, int) or not 0 < sid < 1 << 63:
            raise ValueError(f"sid must be an int in [1, 2**63), got {sid!r}")
        # An unnamed push use goes to the core as sid 0: it tells this use's late calls
        # from a new use's by their blocks (a pull's sid is in its ticket: named).
        use = sid if named or mode is TransferMode.PULL else 0

        def run() -> None:
            self._event(lambda now: self._core.prefill_done(now, request_id, ids, mode, use,
                                                            called))

        if mode is TransferMode.PULL:
            sums = block_checksums(self.layout, ids).astype("<u8").tobytes() \
                if self.config.verify else b""
            ticket = m.PullTicket(producer=self.name, address=self.address,
                                  request_id=request_id, block_ids=m.encode_ids(ids),
                                  lease_s=self.config.lease_s, issued_at=time.time(), sid=sid,
                                  checksums=sums)
            return (ticket if self._key is None else ticket.seal(self._key)), run
        return None, run

    def prefill_done_many(self, items: Sequence[tuple[str, Any] | tuple[str, Any, TransferMode]],
                          mode: TransferMode = TransferMode.PUSH
                          ) -> list[m.PullTicket | Exception | None]:
        """:meth:`prefill_done` for a batch: ``items`` are ``(request_id, block_ids)`` or
        ``(request_id, block_ids, mode)`` (``mode`` is the default of the former). Every
        item is validated on its own; the valid ones reach the loop thread in one
        hand-off, in order. Returns per item what a single call would: its pull ticket,
        None (push), or the exception a single call would have raised (that item's blocks
        are not held: the engine keeps them). Never blocks."""
        def prepare(item: Any) -> tuple[m.PullTicket | None, Callable[[], None]]:
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise ValueError(f"each item is (request_id, block_ids[, mode]), got "
                                 f"{item!r:.80}")
            return self._prepare_prefill(item[0], item[1],
                                         item[2] if len(item) == 3 else mode, None)

        return self._batch(items, prepare)

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
        if sid is not None and (isinstance(sid, bool) or not isinstance(sid, int)
                                or not 0 < sid < 1 << 63):
            raise ValueError(f"sid must be an int in [1, 2**63), got {sid!r}")
        use = sid or 0
        self._call_soon(lambda: self._event(lambda now: self._core.layer_done(
            now, request_id, ids, layer, use)))

    def abort(self, request_id: str, reason: str = "aborted by producer") -> None:
        """Give up ``request_id``'s live use wherever it is: its owners are told, and its
        blocks are released ``ABORTED`` once no transfer can read them (a WRITE in flight
        is left to end: NIXL cannot stop its bytes). An id with no use here yet: its next
        ``prefill_done`` (within ``tombstone_s``) is released ``ABORTED`` at once."""
        check_request_id(request_id)
        self._call_soon(lambda: self._event(lambda now: self._core.abort(
            now, request_id, reason)))

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
        status: RequestStatus = self._call_and_wait(
            lambda: self._core.snapshot(request_id), 10.0, "Producer.status()")
        return status

    def stats(self) -> dict[str, int]:
        """Counters of what this Producer has done (:class:`kvpush.metrics.Stats`)."""
        out = self._stats.as_dict()
        for key, value in self._core.stats.items():
            out[key] = out.get(key, 0) + value
        return out

    @property
    def pending(self) -> int:
        """Requests whose source blocks are held (not yet released)."""
        return self._core.held()

    # -- loop: driving the core ------------------------------------------------------------
    def _event(self, feed: Callable[[float], None]) -> None:
        """Feed one event to the core (loop thread) and carry out what it asks."""
        feed(time.monotonic())
        self._apply()

    def _send_to(self, peer: str, msg: m.Message) -> None:
        tx = self._sessions.seal(peer, msg)
        if tx is not None:
            self._transmit(tx)

    def _notif_sealer(self, peer: str) -> tuple[bool, Sealer | None]:
        consumer = self._sessions.by_agent.get(peer)
        return consumer is not None, consumer.notif_sealer if consumer is not None else None

    def _unreachable(self, peer: str, exc: KvpushError) -> None:
        consumer = self._sessions.by_agent.get(peer)
        if consumer is not None:
            self._drop_consumer(consumer, str(exc), abandon=True)

    def _applied(self) -> None:
        for name, value in self._core.gauges.items():
            if value != self._gauges[name]:
                LIVE.add(name, value - self._gauges[name])
                self._gauges[name] = value

    def _wants_notifications(self) -> bool:
        return bool(self._core.watching_pulls())

    def _notif_opener(self, sender: str) -> tuple[bool, Opener | None]:
        peer = self._sessions.by_agent.get(sender)
        return peer is not None, peer.notif_opener if peer is not None else None

    # -- loop: control messages ------------------------------------------------------------
    def _on_router(self, sock: zmq.Socket[Any]) -> None:
        strangers = 0                   # bytes read this iteration from strangers,
        read: dict[bytes, int] = {}     # and from each of them
        for frames in self._read_frames(sock):
            if len(frames) != 2:
                self._stats.messages_rejected += 1
                continue
            identity, frame = frames[0].bytes, frames[1].buffer
            if self._sessions.connected_at(identity) is None:
                # not authenticated: small frames, and few of them
                size = len(frame)
                spent = read.get(identity, 0) + size
                if size > STRANGER_FRAME_BYTES or spent > STRANGER_PEER_BYTES \
                        or strangers + size > STRANGER_BYTES:
                    self._stats.messages_rejected += 1  # dropped unread
                    continue
                read[identity] = spent
                strangers += size
            effects, got = self._sessions.receive(time.monotonic(), identity, frame)
            self._session(effects)
            if got is not None and not isinstance(got[1], m.Heartbeat):
                self._core.on_message(time.monotonic(), got[0], got[1])
        self._apply()

    @property
    def _consumers(self) -> dict[bytes, Accepted]:
        """Connected consumers by connection identity (tests look)."""
        return self._sessions.consumers

    def _session(self, effects: list[SessionEffect]) -> None:
        """Carry out what the session machine asked, in order."""
        for effect in effects:
            if isinstance(effect, Transmit):
                self._transmit(effect)
            elif isinstance(effect, Admit):
                self._admit(effect)
            elif isinstance(effect, PeerUp):
                self._core.peer_up(time.monotonic(), effect.name, effect.layout)
            elif isinstance(effect, PeerDown):
                if effect.conn:
                    log.info("%s: dropping consumer %s: %s", self.name, effect.name,
                             effect.why)
                    assert isinstance(effect.conn, bytes)
                    self._drop_outbox((self._router, effect.conn))
                self._core.peer_lost(time.monotonic(), effect.name, effect.why,
                                     abandon=effect.abandon)
                self._apply()

    def _transmit(self, tx: Transmit) -> None:
        assert isinstance(tx.peer, bytes)
        if tx.best_effort:
            if not self._try_send(self._router, tx.frame, tx.peer):
                log.info("%s: could not answer a stranger", self.name)
        else:
            self._send_frame(self._router, tx.frame, tx.peer)

    def _admit(self, admit: Admit) -> None:
        """A Hello checked by the session: NIXL takes the consumer's metadata (the HelloAck
        follows), or the Hello is refused."""
        assert isinstance(admit.peer, bytes)
        try:
            agent_name = self._agent.add_peer(admit.metadata, admit.layout, admit.name)
        except PeerUnavailable as exc:
            self._session(self._sessions.refuse(admit.peer, m.HelloReject(str(exc))))
            return
        if agent_name != admit.name:
            self._agent.remove_peer(agent_name)
        self._session(self._sessions.admitted(time.monotonic(), admit.peer, agent_name))

    def _emit(self, release: Any) -> None:
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

    # -- loop: peers -----------------------------------------------------------------------
    def _check_peers(self) -> None:
        """Drop a consumer not heard from for ``peer_timeout_s``; what it sent while this
        loop could not read it (a stall) is read first, so a stalled loop does not take
        its own deafness for the consumer's silence."""
        self._read_waiting()
        self._session(self._sessions.check(time.monotonic()))
        self._after(self.config.peer_timeout_s / 4, self._check_peers)

    def _drop_consumer(self, peer: Accepted, why: str, *, abandon: bool = False) -> None:
        """Forget a consumer's connection; the core ends what it had with it (its NIXL
        state goes once none of its WRITEs is in flight, see :meth:`_forget`)."""
        self._session(self._sessions.drop(peer, why, abandon=abandon))

    def _send_failed(self, sock: zmq.Socket[Any], identity: bytes | None, why: str) -> None:
        peer = self._sessions.connected_at(identity) if identity is not None else None
        if peer is not None:
            self._drop_consumer(peer, why)

    def _forget(self, agent_name: str, why: str) -> None:
        """The core is done with ``agent_name``: drop its NIXL state (unless a newer
        connection under that name uses it)."""
        if self._sessions.forget(agent_name):
            self._agent.remove_peer(agent_name)

    def _data_plane_peers_lost(self, why: str) -> None:
        """The data plane restarted: every consumer's requests fail, and each is told to
        connect again (it needs the new NIXL metadata)."""
        for peer in list(self._sessions.consumers.values()):
            self._session(self._sessions.drop(peer, why, abandon=True, rejoin=True))

    def _debug_state(self, rid: str) -> str:
        """Where ``rid`` is (loop thread; for tests): writing, registered, held-push,
        held-pull, pulling, ending, partial or none."""
        return self._core.debug_state(rid)

    # -- teardown --------------------------------------------------------------------------
    def _on_close(self) -> None:
        for tx in self._sessions.close():
            self._transmit(tx)
        self._release_xfers()
        self._core.close(time.monotonic())
        for effect in self._core.drain():  # only releases: nothing else can be done now
            if isinstance(effect, Emit):
                self._emit(effect.item)
        self._applied()
        self._sessions.consumers.clear()
        self._released.end()
