"""The prefill side: serves handshakes, holds finished blocks, WRITEs them (push) or lets
the consumer READ them (pull), and hands the blocks back to the engine exactly once.

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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from . import messages as m
from .agent import TransportConfig, XferState
from .endpoint import Endpoint, Timer
from .errors import InvalidBlockIds, KvpushError, LayoutMismatch, PeerUnavailable, ProtocolError
from .layout import KVLayout, check_compatible
from .metrics import LIVE, Stats
from .plan import plan_transfer, validate_block_ids
from .progress import ProgressPolicy
from .request import Release, ReleaseReason, TransferMode

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
        A WRITE still in flight after this is cancelled and failed.
    peer_timeout_s
        A consumer silent for this long (no heartbeat) is considered gone.
    tombstone_s
        How long aborted or expired request ids are remembered, so a late registration
        fails fast instead of waiting.
    coalesce
        Merge runs of blocks adjacent on both sides into one descriptor (off only to measure).
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
    transport: TransportConfig = field(default_factory=TransportConfig)
    progress: ProgressPolicy = field(default_factory=ProgressPolicy)

    def __post_init__(self) -> None:
        for name in ("lease_s", "max_wait_s", "transfer_timeout_s", "peer_timeout_s",
                     "tombstone_s"):
            value = getattr(self, name)
            if not 0 < value <= 86400:
                raise ValueError(f"ProducerConfig.{name} must be in (0, 86400] s, got {value}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ProducerConfig.port must be in [0, 65535], got {self.port}")


@dataclass
class _Consumer:
    identity: bytes
    agent_name: str
    layout: KVLayout
    last_seen: float


@dataclass
class _Source:
    ids: np.ndarray
    mode: TransferMode
    lease: Timer
    pulling: bool = False


@dataclass
class _Registration:
    peer: _Consumer
    ids: np.ndarray
    part: int
    wait: Timer


@dataclass
class _Write:
    peer: _Consumer
    handle: Any
    part: int
    nbytes: int
    nblocks: int
    deadline: Timer
    posted_at: float
    abort: str = ""  # who asked to abort while in flight: "consumer" / "producer"


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
                         progress=config.progress)
        self.config = config
        self._on_release = on_release
        self._released: deque[Release] = deque()
        self._stats = Stats()
        self._consumers: dict[bytes, _Consumer] = {}
        self._sources: dict[str, _Source] = {}
        self._registrations: dict[str, _Registration] = {}
        self._writes: dict[str, _Write] = {}
        self._pulls_watched = 0
        self._tombstones: dict[str, tuple[str, str, float]] = {}
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if config.port:
                self._router.bind(f"tcp://{config.host}:{config.port}")
            else:
                self._router.bind(f"tcp://{config.host}:*")
            self.address: str = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
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
                     mode: TransferMode = TransferMode.PUSH) -> m.PullTicket | None:
        """Prefill for ``request_id`` is done; its KV is in ``block_ids`` (int32/int64 array).

        PUSH: the WRITE starts as soon as the consumer's registration is here (at once if it
        already is). PULL: returns the :class:`~kvpush.messages.PullTicket` the router relays
        to the consumer. Either way the blocks are held until released
        (see :meth:`get_released`). Never blocks on transfer setup.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidBlockIds("request_id must be a non-empty str")
        mode = TransferMode(mode)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        self._call_soon(lambda: self._hold(request_id, ids, mode))
        if mode is TransferMode.PULL:
            return m.PullTicket(producer=self.name, address=self.address, request_id=request_id,
                                block_ids=m.encode_ids(ids), lease_s=self.config.lease_s,
                                issued_at=time.time())
        return None

    def abort(self, request_id: str, reason: str = "aborted by producer") -> None:
        """Give up ``request_id`` wherever it is: blocks released with ``ABORTED`` (after any
        WRITE in flight is cancelled or done); the consumer is told."""
        self._call_soon(lambda: self._abort(request_id, reason))

    def get_released(self) -> list[Release]:
        """Releases since the last call (for engines that poll rather than take callbacks)."""
        out = []
        while self._released:
            out.append(self._released.popleft())
        return out

    def stats(self) -> dict[str, int]:
        return self._stats.as_dict()

    @property
    def pending(self) -> int:
        """Requests whose source blocks are held (not yet released)."""
        return len(self._sources)

    # -- loop: control messages ------------------------------------------------------------
    def _on_router(self, sock: zmq.Socket[Any]) -> None:
        for frames in self._recv_all(sock):
            if len(frames) != 2:
                self._stats.messages_rejected += 1
                continue
            identity, frame = frames
            try:
                msg = m.decode(frame)
            except ProtocolError as exc:
                self._stats.messages_rejected += 1
                log.warning("%s: rejected control frame: %s", self.name, exc)
                continue
            peer = self._consumers.get(identity)
            if peer is not None:
                peer.last_seen = time.monotonic()
            if isinstance(msg, m.Hello):
                self._on_hello(identity, msg)
            elif peer is None:
                self._stats.messages_rejected += 1
                if isinstance(msg, m.Register):
                    self._send(sock, m.Failed(msg.request_id, "not_connected",
                                              "no handshake from this consumer"), identity)
                elif isinstance(msg, m.Heartbeat):  # we dropped it; it should know
                    self._send(sock, m.Bye(self.name), identity)
            elif isinstance(msg, m.Register):
                self._on_register(peer, msg)
            elif isinstance(msg, m.Abort):
                self._on_consumer_abort(peer, msg)
            elif isinstance(msg, m.PullBegin):
                self._on_pull_begin(msg)
            elif isinstance(msg, m.Heartbeat):
                self._send(sock, m.HeartbeatAck(msg.seq), identity)
            elif isinstance(msg, m.Bye):
                self._drop_consumer(peer, "consumer closed")
            else:
                self._stats.messages_rejected += 1

    def _on_hello(self, identity: bytes, msg: m.Hello) -> None:
        try:
            remote = KVLayout.from_wire(msg.layout)
            check_compatible(self.layout, remote)
        except LayoutMismatch as exc:
            self._send(self._router, m.HelloReject(str(exc), exc.field, repr(exc.local),
                                                   repr(exc.remote)), identity)
            return
        except ProtocolError as exc:
            self._send(self._router, m.HelloReject(str(exc)), identity)
            return
        old = self._consumers.get(identity)
        if old is not None:  # a restarted peer under the same name: forget the old one first
            self._drop_consumer(old, "consumer reconnected")
        try:
            agent_name = self._agent.add_peer(msg.agent_metadata, remote)
        except PeerUnavailable as exc:
            self._send(self._router, m.HelloReject(str(exc)), identity)
            return
        self._consumers[identity] = _Consumer(identity, agent_name, remote, time.monotonic())
        self._send(self._router, m.HelloAck(self.name, self._agent.metadata(),
                                            self.layout.to_wire()), identity)

    def _on_register(self, peer: _Consumer, msg: m.Register) -> None:
        rid = msg.request_id
        tomb = self._tombstones.get(rid)
        if tomb is not None:
            self._send(self._router, m.Failed(rid, tomb[0], tomb[1]), peer.identity)
            return
        if rid in self._registrations or rid in self._writes:
            self._send(self._router, m.Failed(rid, "duplicate", "request already registered"),
                       peer.identity)
            return
        source = self._sources.get(rid)
        if source is not None and source.mode is TransferMode.PULL:
            self._send(self._router, m.Failed(rid, "mode_conflict",
                                              "the producer exposed this request for pull"),
                       peer.identity)
            return
        try:
            ids = m.decode_ids(msg.block_ids)
        except ProtocolError as exc:
            self._send(self._router, m.Failed(rid, "invalid_ids", str(exc)), peer.identity)
            return
        wait = min(max(msg.wait_s, 0.0), self.config.max_wait_s)
        timer = self._after(wait, lambda: self._registration_expired(rid))
        self._registrations[rid] = _Registration(peer, ids, msg.part, timer)
        LIVE.add("registrations_waiting", 1)
        if source is not None:
            self._trigger(rid)

    def _on_consumer_abort(self, peer: _Consumer, msg: m.Abort) -> None:
        rid = msg.request_id
        self._tomb(rid, "aborted", f"consumer: {msg.reason}")
        write = self._writes.get(rid)
        if write is not None and write.peer is peer:
            write.abort = "consumer"
            if self._agent.release(write.handle):
                self._finish_write(rid, XferState.ERROR, cancelled=True)
            return  # else: AbortAck once NIXL reports the WRITE finished
        reg = self._registrations.get(rid)
        if reg is not None and reg.peer is peer:
            self._drop_registration(rid)
        if rid in self._sources:
            self._release(rid, ReleaseReason.ABORTED, f"consumer: {msg.reason}")
        self._send(self._router, m.AbortAck(rid), peer.identity)

    def _on_pull_begin(self, msg: m.PullBegin) -> None:
        source = self._sources.get(msg.request_id)
        if source is None or source.mode is not TransferMode.PULL or source.pulling:
            return
        source.pulling = True
        self._pulls_watched += 1
        # A READ is in flight: the blocks stay at least until it can have finished.
        source.lease.cancel()
        rid = msg.request_id
        source.lease = self._after(self.config.lease_s + self.config.transfer_timeout_s,
                                   lambda: self._lease_expired(rid))

    # -- loop: rendezvous ------------------------------------------------------------------
    def _hold(self, rid: str, ids: np.ndarray, mode: TransferMode) -> None:
        tomb = self._tombstones.pop(rid, None)
        if rid in self._sources or rid in self._writes:
            log.warning("%s: prefill_done for %r twice; releasing the second set", self.name, rid)
            self._emit(Release(rid, ReleaseReason.FAILED, ids, "duplicate prefill_done"))
            return
        if tomb is not None and tomb[0] == "aborted":
            self._tombstones[rid] = tomb
            self._emit(Release(rid, ReleaseReason.ABORTED, ids, tomb[1]))
            return
        lease = self._after(self.config.lease_s, lambda: self._lease_expired(rid))
        self._sources[rid] = _Source(ids, mode, lease)
        LIVE.add("sources_held", 1)
        reg = self._registrations.get(rid)
        if reg is None:
            return
        if mode is TransferMode.PUSH:
            self._trigger(rid)
        else:
            self._drop_registration(rid)
            self._send(self._router, m.Failed(rid, "mode_conflict",
                                              "the producer exposed this request for pull"),
                       reg.peer.identity)

    def _trigger(self, rid: str) -> None:
        """Both halves are here: map ids and post the WRITE."""
        source = self._sources[rid]
        reg = self._drop_registration(rid)
        source.lease.cancel()
        peer = reg.peer
        try:
            plan = plan_transfer(source.ids, reg.ids, self.layout.num_blocks,
                                 peer.layout.num_blocks, self.layout.num_regions,
                                 self.config.coalesce)
        except InvalidBlockIds as exc:
            self._fail(rid, peer, "invalid_ids", str(exc))
            return
        notif = m.encode(m.Landed(rid, reg.part))
        if plan.num_blocks == 0:  # nothing to move, but the consumer still counts this part
            try:
                self._agent.send_notification(peer.agent_name, notif)
            except KvpushError as exc:
                self._fail(rid, peer, "transfer_failed", str(exc))
                return
            self._send(self._router, m.Posted(rid, reg.part), peer.identity)
            self._release(rid, ReleaseReason.TRANSFERRED)
            return
        try:
            handle = self._agent.post("WRITE", peer.agent_name, plan.local_indices,
                                      plan.remote_indices, notif)
        except PeerUnavailable as exc:
            self._fail(rid, peer, "peer_unavailable", str(exc))
            self._drop_consumer(peer, str(exc))
            return
        except KvpushError as exc:
            self._fail(rid, peer, "transfer_failed", str(exc))
            return
        nbytes = plan.num_blocks * self.layout.bytes_per_block_id
        deadline = self._after(self.config.transfer_timeout_s, lambda: self._write_expired(rid))
        self._writes[rid] = _Write(peer, handle, reg.part, nbytes, plan.num_blocks, deadline,
                                   time.monotonic())
        LIVE.add("transfers_in_flight", 1)
        self._stats.transfers_posted += 1
        self._stats.descriptors_posted += plan.num_descriptors
        self._send(self._router, m.Posted(rid, reg.part), peer.identity)

    # -- loop: progress --------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._writes) or self._pulls_watched > 0

    def _poll_transfers(self) -> bool:
        moved = False
        for rid, write in list(self._writes.items()):
            state = self._agent.state(write.handle)
            if state is not XferState.IN_PROGRESS:
                self._agent.release(write.handle)
                self._finish_write(rid, state)
                moved = True
        if self._pulls_watched:
            for _sender, notes in self._agent.notifications().items():
                for note in notes:
                    moved = True
                    self._on_notification(note)
        return moved

    def _on_notification(self, note: bytes) -> None:
        try:
            msg = m.decode(note)
        except ProtocolError:
            self._stats.messages_rejected += 1
            return
        if not isinstance(msg, m.PullDone):
            self._stats.messages_rejected += 1
            return
        source = self._sources.get(msg.request_id)
        if source is not None and source.mode is TransferMode.PULL:
            self._stats.requests_completed += 1
            self._stats.blocks_moved += len(source.ids)
            self._stats.bytes_moved += len(source.ids) * self.layout.bytes_per_block_id
            self._release(msg.request_id, ReleaseReason.TRANSFERRED)

    def _finish_write(self, rid: str, state: XferState, cancelled: bool = False) -> None:
        write = self._writes.pop(rid)
        write.deadline.cancel()
        LIVE.add("transfers_in_flight", -1)
        peer = write.peer
        if write.abort == "consumer":
            self._send(self._router, m.AbortAck(rid), peer.identity)
            self._release(rid, ReleaseReason.ABORTED, "consumer aborted")
        elif write.abort == "producer":
            self._send(self._router, m.Failed(rid, "aborted", "aborted by producer"),
                       peer.identity)
            self._release(rid, ReleaseReason.ABORTED, "producer aborted")
        elif state is XferState.DONE:
            self._stats.requests_completed += 1
            self._stats.blocks_moved += write.nblocks
            self._stats.bytes_moved += write.nbytes
            self._release(rid, ReleaseReason.TRANSFERRED)
        else:
            code = "timeout" if cancelled else "transfer_failed"
            self._send(self._router, m.Failed(rid, code, f"WRITE {code}"), peer.identity)
            self._release(rid, ReleaseReason.FAILED, f"WRITE {code}")

    # -- loop: deadlines and aborts --------------------------------------------------------
    def _write_expired(self, rid: str) -> None:
        write = self._writes.get(rid)
        if write is None:
            return
        if self._agent.release(write.handle):
            self._stats.requests_timed_out += 1
            self._finish_write(rid, XferState.ERROR, cancelled=True)
        else:  # NIXL could not cancel: the source must stay put until it can
            write.deadline = self._after(1.0, lambda: self._write_expired(rid))

    def _registration_expired(self, rid: str) -> None:
        reg = self._registrations.get(rid)
        if reg is None:
            return
        self._drop_registration(rid)
        self._stats.requests_timed_out += 1
        self._send(self._router, m.Failed(rid, "timeout", "prefill did not finish in time"),
                   reg.peer.identity)

    def _lease_expired(self, rid: str) -> None:
        source = self._sources.get(rid)
        if source is None:
            return
        self._stats.requests_timed_out += 1
        self._tomb(rid, "lease_expired", "source blocks were released after their lease")
        self._release(rid, ReleaseReason.LEASE_EXPIRED)

    def _abort(self, rid: str, reason: str) -> None:
        self._tomb(rid, "aborted", reason)
        self._stats.requests_aborted += 1
        write = self._writes.get(rid)
        if write is not None:
            write.abort = "producer"
            if self._agent.release(write.handle):
                self._finish_write(rid, XferState.ERROR, cancelled=True)
            return
        reg = self._registrations.get(rid)
        if reg is not None:
            self._drop_registration(rid)
            self._send(self._router, m.Failed(rid, "aborted", reason), reg.peer.identity)
        if rid in self._sources:
            self._release(rid, ReleaseReason.ABORTED, reason)

    def _fail(self, rid: str, peer: _Consumer, code: str, reason: str) -> None:
        self._stats.requests_failed += 1
        self._send(self._router, m.Failed(rid, code, reason), peer.identity)
        self._release(rid, ReleaseReason.FAILED, reason)

    def _tomb(self, rid: str, code: str, reason: str) -> None:
        now = time.monotonic()
        if len(self._tombstones) > 4096:  # forget the expired ones
            self._tombstones = {k: v for k, v in self._tombstones.items() if v[2] > now}
        self._tombstones[rid] = (code, reason, now + self.config.tombstone_s)

    def _drop_registration(self, rid: str) -> _Registration:
        reg = self._registrations.pop(rid)
        reg.wait.cancel()
        LIVE.add("registrations_waiting", -1)
        return reg

    def _release(self, rid: str, reason: ReleaseReason, detail: str = "") -> None:
        source = self._sources.pop(rid)
        source.lease.cancel()
        if source.pulling:
            self._pulls_watched -= 1
        LIVE.add("sources_held", -1)
        self._stats.blocks_released += len(source.ids)
        self._emit(Release(rid, reason, source.ids, detail))

    def _emit(self, release: Release) -> None:
        self._released.append(release)
        if self._on_release is not None:
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

    def _drop_consumer(self, peer: _Consumer, why: str) -> None:
        if self._consumers.get(peer.identity) is not peer:
            return
        log.info("%s: dropping consumer %s: %s", self.name, peer.agent_name, why)
        self._stats.peers_lost += 1
        for rid, write in list(self._writes.items()):
            if write.peer is peer:
                # The peer is gone: cancel; if NIXL cannot, the release waits for the poll.
                write.abort = "lost"
                if self._agent.release(write.handle):
                    self._finish_write(rid, XferState.ERROR, cancelled=True)
        for rid, reg in list(self._registrations.items()):
            if reg.peer is peer:
                self._drop_registration(rid)
        del self._consumers[peer.identity]
        self._agent.remove_peer(peer.agent_name)

    def _debug_state(self, rid: str) -> str:
        """Where ``rid`` is (loop thread; for tests): writing, registered, held-push,
        held-pull, pulling or none."""
        if rid in self._writes:
            return "writing"
        if rid in self._registrations:
            return "registered"
        source = self._sources.get(rid)
        if source is not None:
            return "pulling" if source.pulling else f"held-{source.mode.value}"
        return "none"

    # -- teardown --------------------------------------------------------------------------
    def _on_close(self) -> None:
        for peer in list(self._consumers.values()):
            self._send(self._router, m.Bye(self.name), peer.identity)
        for rid, write in list(self._writes.items()):
            write.abort = "producer"
            if not self._agent.release(write.handle):
                log.error("%s: WRITE for %r could not be cancelled at close", self.name, rid)
            self._writes.pop(rid).deadline.cancel()
            LIVE.add("transfers_in_flight", -1)
        for rid in list(self._registrations):
            self._drop_registration(rid)
        for rid in list(self._sources):
            self._release(rid, ReleaseReason.CLOSED, "producer closed")
        self._consumers.clear()
