"""The prefill side: serves handshakes, holds finished blocks, WRITEs them (push) or lets
the consumer READ them (pull), and hands the blocks back to the engine exactly once.

This module is the facade and the I/O driver: it validates the engine's calls on the
caller's thread, owns the control socket, the handshake and the NIXL agent on its loop
thread, feeds every event to the protocol core (:class:`kvpush.protocol.producer.ProducerCore`,
where each request's state machine lives) and carries out the effects the core returns.

Push rendezvous. A request needs two events: the consumer's *registration* (destination
blocks, sent as soon as the decode engine allocated them) and the engine's ``prefill_done``
(source blocks). Whichever comes second triggers the WRITE at once, on the loop thread:
ids -> descriptor indices in C++, ``make_prepped_xfer(WRITE)`` with a ``Landed``
notification, a ``Posted`` hint to the consumer, then polling until NIXL reports the WRITE
done, when the source blocks are released. Deadlines bound both waits: a registration waits
``wait_s`` (chosen by the consumer, capped) for prefill; finished blocks wait ``lease_s``
for a registration.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from . import messages as m
from .agent import TransportConfig, XferState
from .auth import HelloGuard, Opener, Sealer, check_key, new_nonce, session_key
from .endpoint import (
    RESULT_QUEUE,
    Endpoint,
    Timer,
    check_durations,
    control_socket,
    queue_result,
)
from .errors import (
    AuthenticationError,
    KvpushError,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
)
from .layout import KVLayout, check_compatible
from .metrics import LIVE
from .plan import block_checksums, check_request_id, validate_block_ids
from .progress import ProgressPolicy
from .protocol.effects import Abandon, DropPeer, Emit, Post, Send, XferEnd
from .protocol.producer import CoreConfig, ProducerCore
from .request import Release, TransferMode

__all__ = ["Producer", "ProducerConfig"]

log = logging.getLogger("kvpush.producer")


@dataclass(frozen=True)
class ProducerConfig:
    """Producer settings (all durations in seconds).

    Parameters
    ----------
    host, port
        Where the control socket listens (port 0: any free port; see ``Producer.address``).
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
        A consumer silent for this long (no heartbeat) is considered gone.
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


@dataclass
class _Consumer:
    identity: bytes
    agent_name: str
    layout: KVLayout
    last_seen: float
    # With authentication: per-connection session sealers (None without a key).
    sealer: Sealer | None = None
    opener: Opener | None = None
    notif_sealer: Sealer | None = None
    notif_opener: Opener | None = None
    # The Hello this connection answered and the answer, re-sent as is to a retransmit.
    hello_nonce: bytes = b""
    hello_metadata: bytes = b""
    ack_frame: bytes = b""


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


def new_id() -> int:
    """A fresh random 63-bit non-zero id (a source use, a transfer)."""
    return int.from_bytes(os.urandom(8), "little") >> 1 | 1


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
        super().__init__(layout, name=config.name, transport=config.transport,
                         progress=config.progress, auth_key=config.auth_key)
        self.config = config
        self._on_release = on_release
        self._released: deque[Release] = deque(maxlen=RESULT_QUEUE)
        self._consumers: dict[bytes, _Consumer] = {}
        self._by_agent: dict[str, _Consumer] = {}
        self._hello_guard = HelloGuard()
        self._core = ProducerCore(layout, CoreConfig(
            lease_s=config.lease_s, max_wait_s=config.max_wait_s,
            transfer_timeout_s=config.transfer_timeout_s, tombstone_s=config.tombstone_s,
            coalesce=config.coalesce), _Links(self))
        self._xfers: dict[int, Any] = {}        # core transfer key -> NIXL handle
        self._core_timer: Timer | None = None
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
            self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._finalized = False
            self.close()
            raise PeerUnavailable(
                f"cannot listen on {config.host}:{config.port}: {exc}") from exc
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

        ``sid`` names this source use (default: a fresh random one). An engine whose tickets
        are written by another process than the one that calls this (vLLM: the scheduler
        answers the router, the worker holds the Producer) picks it there, fresh for every
        prefill, so both name the same use.
        """
        called = time.monotonic()
        check_request_id(request_id)
        mode = TransferMode(mode)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        if sid is None:
            sid = new_id()
        elif isinstance(sid, bool) or not isinstance(sid, int) or not 0 < sid < 1 << 63:
            raise ValueError(f"sid must be an int in [1, 2**63), got {sid!r}")
        self._call_soon(lambda: self._event(lambda now: self._core.prefill_done(
            now, request_id, ids, mode, sid, called)))
        if mode is TransferMode.PULL:
            sums = block_checksums(self.layout, ids).astype("<u8").tobytes() \
                if self.config.verify else b""
            return m.PullTicket(producer=self.name, address=self.address, request_id=request_id,
                                block_ids=m.encode_ids(ids), lease_s=self.config.lease_s,
                                issued_at=time.time(), sid=sid, checksums=sums)
        return None

    def layer_done(self, request_id: str, block_ids: Any, layer: int) -> None:
        """Layer-wise push: layer ``layer``'s KV for ``request_id`` is final in
        ``block_ids``. A consumer that registered layer by layer (``expect(...,
        layerwise=True)``) gets that layer written at once, while later layers compute.
        Call it for layers as they finish, then :meth:`prefill_done` with the same blocks as
        usual (which also covers any layer not reported). Whole-request registrations just
        wait for ``prefill_done``. The lease starts at ``prefill_done``."""
        check_request_id(request_id)
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer!r}")
        if self.layout.layers_per_region != 1:
            raise ValueError("layer_done needs one layer per region (layers_per_region == 1)")
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        sid = new_id()
        self._call_soon(lambda: self._event(lambda now: self._core.layer_done(
            now, request_id, ids, layer, sid)))

    def abort(self, request_id: str, reason: str = "aborted by producer") -> None:
        """Give up ``request_id``'s live use wherever it is: its owners are told, and its
        blocks are released ``ABORTED`` once no transfer can read them (a WRITE in flight
        is left to end: NIXL cannot stop its bytes). An id with no use here yet: its next
        ``prefill_done`` (within ``tombstone_s``) is released ``ABORTED`` at once."""
        check_request_id(request_id)
        self._call_soon(lambda: self._event(lambda now: self._core.abort(
            now, request_id, reason)))

    def get_released(self) -> list[Release]:
        """Releases since the last call (for engines that poll rather than take callbacks)."""
        out = []
        while self._released:
            out.append(self._released.popleft())
        return out

    def stats(self) -> dict[str, int]:
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

    def _apply(self) -> None:
        while True:
            effects = self._core.drain()
            if not effects:
                break
            for effect in effects:
                if isinstance(effect, Send):
                    peer = self._by_agent.get(effect.peer)
                    if peer is not None and self._consumers.get(peer.identity) is peer:
                        self._tell(peer, effect.msg)
                elif isinstance(effect, Post):
                    self._post(effect)
                elif isinstance(effect, Abandon):
                    self._abandon(effect.key)
                elif isinstance(effect, Emit):
                    assert isinstance(effect.item, Release)
                    self._emit(effect.item)
                elif isinstance(effect, DropPeer):
                    self._forget(effect.peer, effect.why)
        for name, value in self._core.gauges.items():
            if value != self._gauges[name]:
                LIVE.add(name, value - self._gauges[name])
                self._gauges[name] = value
        deadline = self._core.next_deadline()
        timer = self._core_timer
        if deadline is not None and (timer is None or timer.cancelled
                                     or deadline < timer.deadline):
            if timer is not None:
                timer.cancel()
            self._core_timer = self._at(deadline, self._tick)

    def _tick(self) -> None:
        self._core_timer = None
        self._event(self._core.tick)

    def _post(self, effect: Post) -> None:
        now = time.monotonic()
        peer = self._by_agent.get(effect.peer)
        if peer is None:
            self._core.transfer_ended(now, effect.key, XferEnd.LOST)
            return
        try:
            handle = self._agent.post(effect.op, effect.peer, effect.local, effect.remote,
                                      m.encode(effect.notif, peer.notif_sealer))
        except PeerUnavailable as exc:
            self._core.transfer_ended(now, effect.key, XferEnd.LOST)
            self._drop_consumer(peer, str(exc), abandon=True)
            return
        except KvpushError as exc:
            log.warning("%s: %s", self.name, exc)
            self._core.transfer_ended(now, effect.key, XferEnd.ERROR)
            return
        self._xfers[effect.key] = handle
        LIVE.add("transfers_in_flight", 1)
        self._check(effect.key, handle)  # on a host UCX often finishes inside the post

    def _check(self, key: int, handle: Any) -> bool:
        state = self._agent.state(handle)
        if state is XferState.IN_PROGRESS:
            return False
        self._agent.release(handle)
        self._end(key, XferEnd.DONE if state is XferState.DONE else XferEnd.ERROR)
        return True

    def _end(self, key: int, end: XferEnd) -> None:
        del self._xfers[key]
        LIVE.add("transfers_in_flight", -1)
        self._core.transfer_ended(time.monotonic(), key, end)

    def _abandon(self, key: int) -> None:
        """Give up a WRITE (its deadline passed, or its consumer is gone): release it and
        tell the core how it ended. If NIXL refuses the release, the WRITE stays polled and
        is reported when it ends."""
        handle = self._xfers.get(key)
        if handle is None:
            return
        state = self._agent.state(handle)
        if not self._agent.release(handle):
            log.warning("%s: NIXL refused to release a WRITE; still polling it", self.name)
            return
        self._end(key, XferEnd.ABANDONED if state is XferState.IN_PROGRESS
                  else XferEnd.DONE if state is XferState.DONE else XferEnd.ERROR)

    # -- loop: progress --------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._xfers) or self._core.watching_pulls()

    def _poll_transfers(self) -> bool:
        moved = False
        for key, handle in list(self._xfers.items()):
            moved |= self._check(key, handle)
        if self._core.watching_pulls():
            for sender, msg in self._notifications():
                moved = True
                self._core.on_notification(time.monotonic(), sender, msg)
        if moved:
            self._apply()
        return moved

    def _notif_opener(self, sender: str) -> tuple[bool, Opener | None]:
        peer = self._by_agent.get(sender)
        return peer is not None, peer.notif_opener if peer is not None else None

    # -- loop: control messages ------------------------------------------------------------
    def _on_router(self, sock: zmq.Socket[Any]) -> None:
        for frames in self._recv_all(sock):
            if len(frames) != 2:
                self._stats.messages_rejected += 1
                continue
            identity, frame = frames
            peer = self._consumers.get(identity)
            try:
                msg = self._decode(peer, frame)
            except AuthenticationError as exc:
                self._stats.auth_rejected += 1
                log.warning("%s: rejected control frame: %s", self.name, exc)
                if peer is None:  # tell a would-be peer why its handshake fails
                    self._send(sock, m.HelloReject(str(exc), "auth_key"), identity,
                               best_effort=True)
                continue
            except ProtocolError as exc:
                self._stats.messages_rejected += 1
                log.warning("%s: rejected control frame: %s", self.name, exc)
                continue
            if peer is not None:
                peer.last_seen = time.monotonic()
            if isinstance(msg, m.Hello):
                self._on_hello(identity, msg)
            elif peer is None:
                self._stats.messages_rejected += 1
                if isinstance(msg, (m.Register, m.PullBegin, m.Claim)):
                    self._send(sock, m.Failed(msg.request_id, msg.xid, "not_connected",
                                              "no handshake from this consumer"), identity,
                               best_effort=True)
                elif isinstance(msg, m.Heartbeat):  # we dropped it; it should know
                    self._send(sock, m.Bye(self.name), identity, best_effort=True)
            elif isinstance(msg, m.Heartbeat):
                self._tell(peer, m.HeartbeatAck(msg.seq))
            elif isinstance(msg, m.Bye):
                self._drop_consumer(peer, "consumer closed")
            else:
                self._core.on_message(time.monotonic(), peer.agent_name, msg)
        self._apply()

    def _decode(self, peer: _Consumer | None, frame: bytes) -> m.Message:
        if self._key is None:
            return m.decode(frame)
        if peer is not None and peer.opener is not None and m.is_sealed(frame):
            try:
                return m.decode(frame, peer.opener)
            except AuthenticationError:
                pass  # maybe a Hello from the same peer, restarted: sealed with the key
        msg = m.decode(frame, Opener(self._key, b"hello", replay=False))
        if not isinstance(msg, m.Hello):
            raise AuthenticationError(f"{type(msg).__name__} sealed with the handshake key")
        if peer is None or msg.nonce != peer.hello_nonce:  # a retransmit is answered again
            self._hello_guard.check(msg.nonce, msg.sent_at)
        return msg

    def _on_hello(self, identity: bytes, msg: m.Hello) -> None:
        old = self._consumers.get(identity)
        if old is not None and old.ack_frame and (
                msg.nonce == old.hello_nonce if self._key is not None
                else msg.agent_metadata == old.hello_metadata):
            # A retransmit of the Hello this connection answered (the consumer re-sends
            # until it hears back, and a slow answer crosses them): the same answer again,
            # so both sides keep one session.
            self._send_frame(self._router, old.ack_frame, identity)
            return
        try:
            remote = KVLayout.from_wire(msg.layout)
            check_compatible(self.layout, remote)
        except LayoutMismatch as exc:
            self._send(self._router, m.HelloReject(str(exc), exc.field, repr(exc.local),
                                                   repr(exc.remote)), identity,
                       best_effort=True)
            return
        except ProtocolError as exc:
            self._send(self._router, m.HelloReject(str(exc)), identity, best_effort=True)
            return
        if old is not None:  # a restarted peer under the same name: forget the old one first
            self._drop_consumer(old, "consumer reconnected", abandon=True)
        try:
            agent_name = self._agent.add_peer(msg.agent_metadata, remote)
        except PeerUnavailable as exc:
            self._send(self._router, m.HelloReject(str(exc)), identity, best_effort=True)
            return
        peer = _Consumer(identity, agent_name, remote, time.monotonic())
        ack = m.HelloAck(self.name, self._agent.metadata(), self.layout.to_wire())
        ack_sealer = None
        if self._key is not None:
            nonce = new_nonce()
            session = session_key(self._key, msg.nonce, nonce)
            peer.sealer, peer.opener = Sealer(session, b"p2c"), Opener(session, b"c2p")
            peer.notif_sealer = Sealer(session, b"p2c-notif")
            peer.notif_opener = Opener(session, b"c2p-notif")
            ack = m.HelloAck(self.name, self._agent.metadata(), self.layout.to_wire(),
                             nonce=nonce, echo=msg.nonce)
            ack_sealer = Sealer(self._key, b"hello-ack")
        peer.hello_nonce, peer.hello_metadata = msg.nonce, msg.agent_metadata
        peer.ack_frame = m.encode(ack, ack_sealer)
        self._consumers[identity] = peer
        self._by_agent[agent_name] = peer
        self._core.peer_up(time.monotonic(), agent_name, remote)
        self._send_frame(self._router, peer.ack_frame, identity)


    def _tell(self, peer: _Consumer, msg: m.Message) -> None:
        self._send(self._router, msg, peer.identity, peer.sealer)

    def _emit(self, release: Release) -> None:
        if self._on_release is None:
            queue_result(self._released, release, self.name, "get_released")
            return
        try:
            self._on_release(release)
        except Exception:
            log.exception("%s: on_release callback raised", self.name)

    # -- loop: peers -----------------------------------------------------------------------
    def _check_peers(self) -> None:
        now = time.monotonic()
        for peer in list(self._consumers.values()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                self._drop_consumer(peer, f"no heartbeat for {self.config.peer_timeout_s} s")
        self._after(self.config.peer_timeout_s / 4, self._check_peers)

    def _drop_consumer(self, peer: _Consumer, why: str, *, abandon: bool = False) -> None:
        """Forget a consumer's connection; the core ends what it had with it (its NIXL
        state goes once none of its WRITEs is in flight, see :meth:`_forget`)."""
        if self._consumers.get(peer.identity) is not peer:
            return
        log.info("%s: dropping consumer %s: %s", self.name, peer.agent_name, why)
        self._stats.peers_lost += 1
        del self._consumers[peer.identity]
        self._drop_outbox((self._router, peer.identity))
        self._core.peer_lost(time.monotonic(), peer.agent_name, why, abandon=abandon)
        self._apply()

    def _send_failed(self, sock: zmq.Socket[Any], identity: bytes | None, why: str) -> None:
        peer = self._consumers.get(identity) if identity is not None else None
        if peer is not None:
            self._drop_consumer(peer, why)

    def _forget(self, agent_name: str, why: str) -> None:
        """The core is done with ``agent_name``: drop its NIXL state."""
        peer = self._by_agent.get(agent_name)
        if peer is not None and peer.identity not in self._consumers:
            del self._by_agent[agent_name]
        if peer is None or peer.identity not in self._consumers:
            self._agent.remove_peer(agent_name)

    def _debug_state(self, rid: str) -> str:
        """Where ``rid`` is (loop thread; for tests): writing, registered, held-push,
        held-pull, pulling, ending, partial or none."""
        return self._core.debug_state(rid)

    # -- teardown --------------------------------------------------------------------------
    def _on_close(self) -> None:
        for peer in list(self._consumers.values()):
            self._tell(peer, m.Bye(self.name))
        for key, handle in list(self._xfers.items()):
            if not self._agent.release(handle):
                log.error("%s: a WRITE could not be cancelled at close", self.name)
            del self._xfers[key]
            LIVE.add("transfers_in_flight", -1)
        self._core.close(time.monotonic())
        for effect in self._core.drain():
            if isinstance(effect, Emit):
                assert isinstance(effect.item, Release)
                self._emit(effect.item)
        for name, value in self._core.gauges.items():
            LIVE.add(name, value - self._gauges[name])
            self._gauges[name] = value
        self._consumers.clear()
