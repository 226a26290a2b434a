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
import math
import time
from collections import OrderedDict, deque
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
    close_dead_links,
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
from .request import Release, ReleaseReason, TransferMode

__all__ = ["Producer", "ProducerConfig"]

#: Bound on a registration's part index (producer ranks x layer groups).
MAX_PARTS = 1 << 20

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


@dataclass
class _Source:
    """Source blocks the engine handed over and kvpush holds until it releases them."""

    ids: np.ndarray
    mode: TransferMode
    lease: Timer
    pulling: bool = False
    complete: bool = True            # False while only some layers are final (layer_done)
    layers: set[int] = field(default_factory=set)   # final layers, while not complete
    puller: _Consumer | None = None  # pull: the consumer whose READ is (or was) in flight
    aborted: str = ""                # pull: aborted, but kept until no READ can touch it
    stamps: dict[str, float] = field(default_factory=dict)  # Release.timings, so far


@dataclass
class _Registration:
    peer: _Consumer
    ids: np.ndarray
    part: int
    wait: Timer
    verify: bool
    groups: int                      # 1: one WRITE; num_layers: a WRITE per layer
    tail: bool                       # only the last len(ids) source blocks
    arrived: float = 0.0             # monotonic


@dataclass
class _Write:
    handle: Any
    nbytes: int
    nblocks: int
    deadline: Timer


@dataclass
class _Push:
    """A push under way: registration and source matched, WRITEs posted group by group."""

    reg: _Registration
    plan: Any                        # kvpush._core.TransferPlan
    src: np.ndarray                  # the source blocks sent (all, or the tail)
    posted: set[int] = field(default_factory=set)
    writes: dict[int, _Write] = field(default_factory=dict)   # in flight, by group
    # Once set, the push ends as soon as no WRITE is in flight:
    # (message to the consumer: "ack" | a Failed code | "" for none, release reason, detail)
    end: tuple[str, ReleaseReason, str] | None = None
    errored: list[int] = field(default_factory=list)  # parts whose WRITE ended in error
    unfenced: bool = False           # a WRITE was abandoned while still in progress

    @property
    def peer(self) -> _Consumer:
        return self.reg.peer


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
        self._sources: dict[str, _Source] = {}
        self._registrations: dict[str, _Registration] = {}
        self._pushes: dict[str, _Push] = {}
        self._pulls_watched = 0
        # request id -> (Failed code, reason, expiry, source already released)
        self._tombstones: dict[str, tuple[str, str, float, bool]] = {}
        # Pulls whose PullDone (a NIXL notification) overtook their PullBegin (ZeroMQ): the
        # READ ended while the blocks were held, so a late PullBegin gets PullHeld.
        self._pulled: OrderedDict[str, None] = OrderedDict()
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            close_dead_links(self._router, self.config.peer_timeout_s)
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
                     mode: TransferMode = TransferMode.PUSH) -> m.PullTicket | None:
        """Prefill for ``request_id`` is done; its KV is in ``block_ids`` (int32/int64 array).

        PUSH: the WRITE starts as soon as the consumer's registration is here (at once if it
        already is). PULL: returns the :class:`~kvpush.messages.PullTicket` the router relays
        to the consumer. Either way the blocks are held until released
        (see :meth:`get_released`). Never blocks on transfer setup.
        """
        called = time.monotonic()
        check_request_id(request_id)
        mode = TransferMode(mode)
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        self._call_soon(lambda: self._hold(request_id, ids, mode, called))
        if mode is TransferMode.PULL:
            sums = block_checksums(self.layout, ids).astype("<u8").tobytes() \
                if self.config.verify else b""
            return m.PullTicket(producer=self.name, address=self.address, request_id=request_id,
                                block_ids=m.encode_ids(ids), lease_s=self.config.lease_s,
                                issued_at=time.time(), checksums=sums)
        return None

    def layer_done(self, request_id: str, block_ids: Any, layer: int) -> None:
        """Layer-wise push: layer ``layer``'s KV for ``request_id`` is final in
        ``block_ids``. A consumer that registered layer by layer (``expect(...,
        layerwise=True)``) gets that layer written at once, while later layers compute.
        Call it for layers as they finish, then :meth:`prefill_done` with the same blocks as
        usual (which also covers any layer not reported). Whole-request registrations just
        wait for ``prefill_done``."""
        check_request_id(request_id)
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must be in [0, {self.layout.num_layers}), got {layer!r}")
        if self.layout.layers_per_region != 1:
            raise ValueError("layer_done needs one layer per region (layers_per_region == 1)")
        ids = validate_block_ids(block_ids, self.layout.num_blocks, "block_ids")
        self._call_soon(lambda: self._layer(request_id, ids, layer))

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
            peer = self._consumers.get(identity)
            try:
                msg = self._decode(peer, frame)
            except AuthenticationError as exc:
                self._stats.auth_rejected += 1
                log.warning("%s: rejected control frame: %s", self.name, exc)
                if peer is None:  # tell a would-be peer why its handshake fails
                    self._send(sock, m.HelloReject(str(exc), "auth_key"), identity)
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
                self._on_pull_begin(peer, msg)
            elif isinstance(msg, m.PullDone):  # an empty pull: no READ carried it
                self._on_pull_done(msg)
            elif isinstance(msg, m.Heartbeat):
                self._tell(peer, m.HeartbeatAck(msg.seq))
            elif isinstance(msg, m.Bye):
                self._drop_consumer(peer, "consumer closed")
            else:
                self._stats.messages_rejected += 1

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
        self._hello_guard.check(msg.nonce, msg.sent_at)
        return msg

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
        self._consumers[identity] = peer
        self._by_agent[agent_name] = peer
        self._send(self._router, ack, identity, ack_sealer)

    def _on_register(self, peer: _Consumer, msg: m.Register) -> None:
        rid = msg.request_id
        tomb = self._tombstones.get(rid)
        if tomb is not None:
            self._tell(peer, m.Failed(rid, tomb[0], tomb[1]))
            return
        if rid in self._registrations or rid in self._pushes:
            self._tell(peer, m.Failed(rid, "duplicate", "request already registered"))
            return
        source = self._sources.get(rid)
        if source is not None and source.mode is TransferMode.PULL:
            self._tell(peer, m.Failed(rid, "mode_conflict",
                                      "the producer exposed this request for pull"))
            return
        if msg.groups != 1 and (msg.groups != self.layout.num_layers
                                or self.layout.layers_per_region != 1):
            self._tell(peer, m.Failed(rid, "invalid_groups",
                                      f"{msg.groups} layer groups requested; this producer "
                                      f"writes 1 or {self.layout.num_layers} (one per layer)"))
            return
        try:
            ids = m.decode_ids(msg.block_ids)
        except ProtocolError as exc:
            self._tell(peer, m.Failed(rid, "invalid_ids", str(exc)))
            return
        if not 0 <= msg.part < MAX_PARTS:
            self._tell(peer, m.Failed(rid, "invalid_part", f"part {msg.part} out of range"))
            return
        # A NaN or infinite wait must never reach the timer heap.
        wait = min(max(msg.wait_s, 0.0), self.config.max_wait_s) \
            if math.isfinite(msg.wait_s) else self.config.max_wait_s
        timer = self._after(wait, lambda: self._registration_expired(rid))
        self._registrations[rid] = _Registration(peer, ids, msg.part, timer, msg.verify,
                                                 msg.groups, msg.tail, time.monotonic())
        LIVE.add("registrations_waiting", 1)
        if source is not None:
            self._match(rid)

    def _on_consumer_abort(self, peer: _Consumer, msg: m.Abort) -> None:
        rid = msg.request_id
        push = self._pushes.get(rid)
        if push is not None and push.peer is not peer:
            return
        self._tomb(rid, "aborted", f"consumer: {msg.reason}", released=rid in self._sources)
        if push is not None:  # AbortAck once no WRITE is in flight
            self._end_push(rid, "ack", ReleaseReason.ABORTED, f"consumer: {msg.reason}")
            return
        reg = self._registrations.get(rid)
        if reg is not None and reg.peer is peer:
            self._drop_registration(rid)
        source = self._sources.get(rid)
        if source is not None and source.pulling and source.puller is peer:
            # Its READ may still run (and over TCP needs this side to progress): keep the
            # blocks until its PullDone, or the lease.
            source.aborted = source.aborted or f"consumer: {msg.reason}"
        elif source is not None:
            self._release(rid, ReleaseReason.ABORTED, f"consumer: {msg.reason}")
        self._tell(peer, m.AbortAck(rid))

    def _on_pull_begin(self, peer: _Consumer, msg: m.PullBegin) -> None:
        """A READ of a pulled request is in flight: confirm the blocks are held (the
        consumer reports READY only after this ``PullHeld``) or say why they are not."""
        source = self._sources.get(msg.request_id)
        if source is not None and source.pulling and source.puller is peer:
            return  # a duplicate
        if source is None and msg.request_id in self._pulled:
            del self._pulled[msg.request_id]
            self._tell(peer, m.PullHeld(msg.request_id))
            return
        if source is None or source.mode is not TransferMode.PULL or source.pulling:
            tomb = self._tombstones.get(msg.request_id)
            code, reason = (tomb[0], tomb[1]) if tomb is not None else (
                "not_held", "the producer does not hold this request's blocks for a pull")
            self._tell(peer, m.Failed(msg.request_id, code, reason))
            return
        source.pulling = True
        source.puller = peer
        source.stamps["pull_begin"] = time.monotonic()
        if source.aborted:
            self._tell(peer, m.Failed(msg.request_id, "aborted", source.aborted))
        else:
            self._tell(peer, m.PullHeld(msg.request_id))
        self._pulls_watched += 1
        # A READ is in flight: the blocks stay at least until it can have finished.
        source.lease.cancel()
        rid = msg.request_id
        source.lease = self._after(self.config.lease_s + self.config.transfer_timeout_s,
                                   lambda: self._lease_expired(rid))

    # -- loop: rendezvous ------------------------------------------------------------------
    def _hold(self, rid: str, ids: np.ndarray, mode: TransferMode, called: float) -> None:
        """prefill_done, on the loop thread (``called``: when the engine called it)."""
        stamps = {"prefill_done": called, "held": time.monotonic()}
        tomb = self._tombstones.get(rid)
        if tomb is not None and tomb[0] == "failed" and tomb[3]:
            return  # a layer-wise push that failed released these blocks already
        if tomb is not None and tomb[0] == "aborted":
            if tomb[3]:
                return  # these blocks were released already
            self._tombstones[rid] = (*tomb[:3], True)
            if mode is TransferMode.PULL:
                # The engine already handed out a ticket for these blocks: keep them under
                # the lease like any pull source, so no READ sees reused memory.
                lease = self._after(self.config.lease_s, lambda: self._lease_expired(rid))
                self._sources[rid] = _Source(ids, mode, lease, aborted=tomb[1], stamps=stamps)
                LIVE.add("sources_held", 1)
                return
            self._emit(Release(rid, ReleaseReason.ABORTED, ids, tomb[1]))
            return
        self._tombstones.pop(rid, None)
        source = self._sources.get(rid)
        if source is not None and not source.complete and mode is TransferMode.PUSH \
                and np.array_equal(source.ids, ids):
            source.complete = True  # the last layers are final too
            source.stamps.update(stamps)
            if rid in self._pushes:
                self._pump(rid)
            elif rid in self._registrations:
                self._match(rid)
            else:
                self._renew_lease(rid, source)
            return
        if source is not None:
            log.warning("%s: prefill_done for %r twice; releasing the second set", self.name, rid)
            self._emit(Release(rid, ReleaseReason.FAILED, ids, "duplicate prefill_done"))
            return
        lease = self._after(self.config.lease_s, lambda: self._lease_expired(rid))
        self._sources[rid] = _Source(ids, mode, lease, stamps=stamps)
        LIVE.add("sources_held", 1)
        if rid in self._registrations:
            self._match(rid)

    def _layer(self, rid: str, ids: np.ndarray, layer: int) -> None:
        """layer_done, on the loop thread."""
        if rid in self._tombstones:
            return  # aborted or expired: prefill_done settles the blocks
        source = self._sources.get(rid)
        if source is None:
            lease = self._after(self.config.lease_s, lambda: self._lease_expired(rid))
            source = self._sources[rid] = _Source(ids, TransferMode.PUSH, lease, complete=False,
                                                  stamps={"held": time.monotonic()})
            LIVE.add("sources_held", 1)
        elif source.complete or not np.array_equal(source.ids, ids):
            log.warning("%s: layer_done(%r, %d) does not match the blocks held; ignored",
                        self.name, rid, layer)
            return
        source.layers.add(layer)
        if rid in self._pushes:
            self._pump(rid)
        elif rid in self._registrations:
            self._match(rid)

    def _renew_lease(self, rid: str, source: _Source) -> None:
        source.lease.cancel()
        source.lease = self._after(self.config.lease_s, lambda: self._lease_expired(rid))

    def _match(self, rid: str) -> None:
        """Registration and source are both here: plan once, then post what is final."""
        source = self._sources[rid]
        reg = self._registrations.pop(rid)
        LIVE.add("registrations_waiting", -1)
        source.stamps["registered"] = reg.arrived
        if source.mode is TransferMode.PULL:
            reg.wait.cancel()
            self._tell(reg.peer, m.Failed(rid, "mode_conflict",
                                          "the producer exposed this request for pull"))
            return
        if reg.groups == 1 and not source.complete:
            # Whole-request push: wait for prefill_done (the registration's deadline holds).
            self._registrations[rid] = reg
            LIVE.add("registrations_waiting", 1)
            return
        source.lease.cancel()
        src = source.ids
        if reg.tail and len(reg.ids) <= len(src):  # the consumer holds the prefix already
            src = src[len(src) - len(reg.ids):]
        try:
            plan = self._agent.link(reg.peer.agent_name).plan(
                src, reg.ids, self.layout.num_blocks, self.layout.num_regions,
                self.config.coalesce)
        except KvpushError as exc:
            reg.wait.cancel()
            self._stats.requests_failed += 1
            self._tell(reg.peer, m.Failed(rid, "invalid_ids", str(exc)))
            self._release(rid, ReleaseReason.FAILED, str(exc))
            return
        self._pushes[rid] = _Push(reg, plan, src)
        self._pump(rid)

    def _pump(self, rid: str) -> None:
        """Post every group that is final and not posted yet."""
        push = self._pushes[rid]
        source = self._sources[rid]
        groups = push.reg.groups
        for group in range(groups):
            if push.end is not None:
                break
            if group in push.posted or not (source.complete or group in source.layers):
                continue
            self._post(rid, push, group)
        if len(push.posted) == groups:
            push.reg.wait.cancel()  # nothing left to wait for from the engine
        self._conclude(rid)

    def _post(self, rid: str, push: _Push, group: int) -> None:
        reg, plan, peer = push.reg, push.plan, push.peer
        n = len(plan.local_indices) // self.layout.num_regions  # descriptors per region
        if reg.groups == 1:
            lo, hi = 0, self.layout.num_regions
        else:
            per_layer = self.layout.num_regions // self.layout.num_layers
            lo, hi = group * per_layer, (group + 1) * per_layer
        part = reg.part * reg.groups + group
        sums = b""
        if reg.verify and reg.groups == 1:
            sums = block_checksums(self.layout, push.src).astype("<u8").tobytes()
        try:
            nbytes = (hi - lo) * n * self._agent.link(peer.agent_name).desc_bytes
        except PeerUnavailable:
            nbytes = 0
        notif = m.encode(m.Landed(rid, part, sums, nbytes), peer.notif_sealer)
        push.posted.add(group)
        if n == 0:  # nothing to move, but the consumer still counts this part
            self._tell(peer, m.Posted(rid, part, empty=True))
            return
        self._sources[rid].stamps.setdefault("posted", time.monotonic())
        # The hint goes out before the WRITE: the consumer wakes and starts polling for the
        # Landed notification while the bytes move, instead of a wake-up after them.
        self._tell(peer, m.Posted(rid, part))
        try:
            handle = self._agent.post("WRITE", peer.agent_name,
                                      plan.local_indices[lo * n:hi * n],
                                      plan.remote_indices[lo * n:hi * n], notif)
        except KvpushError as exc:
            push.errored.append(part)  # never posted: nothing of it will land
            if isinstance(exc, PeerUnavailable):
                self._end_push(rid, "peer_unavailable", ReleaseReason.FAILED, str(exc))
                self._drop_consumer(peer, str(exc))
            else:
                self._end_push(rid, "transfer_failed", ReleaseReason.FAILED, str(exc))
            return
        deadline = self._after(self.config.transfer_timeout_s,
                               lambda: self._write_expired(rid, group))
        push.writes[group] = _Write(handle, nbytes, plan.num_blocks, deadline)
        LIVE.add("transfers_in_flight", 1)
        self._stats.transfers_posted += 1
        self._stats.descriptors_posted += plan.num_runs * (hi - lo)
        state = self._agent.state(handle)
        if state is not XferState.IN_PROGRESS:  # on a host UCX often finishes in the post
            self._agent.release(handle)
            self._write_finished(rid, group, state)

    # -- loop: progress --------------------------------------------------------------------
    def _busy(self) -> bool:
        return self._in_flight > 0 or self._pulls_watched > 0

    @property
    def _in_flight(self) -> int:
        return sum(len(p.writes) for p in self._pushes.values())

    def _poll_transfers(self) -> bool:
        moved = False
        for rid, push in list(self._pushes.items()):
            for group, write in list(push.writes.items()):
                state = self._agent.state(write.handle)
                if state is not XferState.IN_PROGRESS:
                    self._agent.release(write.handle)
                    self._write_finished(rid, group, state)
                    moved = True
        if self._pulls_watched:
            for _sender, msg in self._notifications():
                moved = True
                if isinstance(msg, m.PullDone):
                    self._on_pull_done(msg)
                else:
                    self._stats.messages_rejected += 1
        return moved

    def _notif_opener(self, sender: str) -> tuple[bool, Opener | None]:
        peer = self._by_agent.get(sender)
        return peer is not None, peer.notif_opener if peer is not None else None

    def _on_pull_done(self, msg: m.PullDone) -> None:
        source = self._sources.get(msg.request_id)
        if source is not None and source.mode is TransferMode.PULL:
            if source.aborted:
                self._release(msg.request_id, ReleaseReason.ABORTED, source.aborted)
                return
            self._stats.requests_completed += 1
            self._stats.blocks_moved += len(source.ids)
            self._stats.bytes_moved += msg.nbytes
            if not source.pulling:
                self._pulled[msg.request_id] = None
                if len(self._pulled) > 4096:
                    self._pulled.popitem(last=False)
            self._release(msg.request_id, ReleaseReason.TRANSFERRED)

    def _write_finished(self, rid: str, group: int, state: XferState,
                        abandoned: bool = False) -> None:
        push = self._pushes[rid]
        write = push.writes.pop(group)
        write.deadline.cancel()
        LIVE.add("transfers_in_flight", -1)
        source = self._sources.get(rid)
        if source is not None:
            source.stamps["written"] = time.monotonic()
        if state is XferState.DONE:
            self._stats.blocks_moved += write.nblocks if group == 0 else 0
            self._stats.bytes_moved += write.nbytes
        else:
            if not abandoned:  # in error: UCX delivers nothing more of it
                push.errored.append(push.reg.part * push.reg.groups + group)
            if push.end is None:
                code = "timeout" if abandoned else "transfer_failed"
                self._stats.requests_timed_out += abandoned
                self._end_push(rid, code, ReleaseReason.FAILED, f"WRITE {code}")
        self._conclude(rid)

    def _end_push(self, rid: str, message: str, reason: ReleaseReason, detail: str,
                  abandon: bool = False) -> None:
        """End a push that will not complete; conclude once no WRITE is in flight.

        WRITEs in flight are left to finish (done or in error, bounded by their deadline):
        releasing a NIXL transfer in progress does not stop its bytes, so only its real end
        lets the consumer know nothing more lands. ``abandon`` (the consumer is gone) releases
        them at once: the source blocks go back to the engine, and what may still land
        belongs to a consumer that reports its blocks unsafe."""
        push = self._pushes[rid]
        if push.end is None:
            push.end = (message, reason, detail)
            push.reg.wait.cancel()
        if abandon:
            for group in list(push.writes):
                self._abandon_write(rid, push, group)
        self._conclude(rid)

    def _abandon_write(self, rid: str, push: _Push, group: int) -> None:
        """Give up a WRITE (its deadline passed, or the consumer is gone) and finish it with
        its state; one still in progress makes the push unfenced. If NIXL refuses the
        release, the WRITE stays in flight and this is tried again in a second."""
        write = push.writes[group]
        state = self._agent.state(write.handle)
        if not self._agent.release(write.handle):
            log.warning("%s: NIXL refused to release the WRITE of %r", self.name, rid)
            write.deadline.cancel()
            write.deadline = self._after(1.0, lambda: self._write_expired(rid, group))
            return
        abandoned = state is XferState.IN_PROGRESS
        if abandoned:
            push.unfenced = True
            self._stats.transfers_abandoned += 1
        self._write_finished(rid, group, state, abandoned)

    def _conclude(self, rid: str) -> None:
        """Release the source and tell the consumer, once nothing is in flight."""
        push = self._pushes.get(rid)
        if push is None or push.writes:
            return
        if push.end is None:
            if len(push.posted) < push.reg.groups:
                return  # layers still to come
            del self._pushes[rid]
            self._stats.requests_completed += 1
            self._release(rid, ReleaseReason.TRANSFERRED)
            return
        message, reason, detail = push.end
        del self._pushes[rid]
        source = self._sources.get(rid)
        if source is not None and not source.complete:
            # Layer-wise, ended before prefill_done: the late prefill_done names the blocks
            # released here and must not hold (or release) them a second time.
            self._tomb(rid, "aborted" if reason is ReleaseReason.ABORTED else "failed",
                       detail, released=True)
        if reason is ReleaseReason.FAILED:
            self._stats.requests_failed += 1
        if message == "ack":
            self._tell(push.peer, m.AbortAck(rid, push.errored, push.unfenced))
        elif message:
            self._tell(push.peer, m.Failed(rid, message, detail, push.errored, push.unfenced))
        if rid in self._sources:
            self._release(rid, reason, detail)

    # -- loop: deadlines and aborts --------------------------------------------------------
    def _write_expired(self, rid: str, group: int) -> None:
        push = self._pushes.get(rid)
        write = push.writes.get(group) if push is not None else None
        if push is None or write is None:
            return
        self._abandon_write(rid, push, group)

    def _registration_expired(self, rid: str) -> None:
        self._stats.requests_timed_out += 1
        if rid in self._pushes:  # layer-wise: the last layers never came
            self._end_push(rid, "timeout", ReleaseReason.FAILED, "prefill did not finish in time")
            return
        reg = self._registrations.get(rid)
        if reg is None:
            return
        self._drop_registration(rid)
        self._tell(reg.peer, m.Failed(rid, "timeout", "prefill did not finish in time"))

    def _lease_expired(self, rid: str) -> None:
        source = self._sources.get(rid)
        if source is None or rid in self._pushes:
            return
        if source.aborted:
            self._release(rid, ReleaseReason.ABORTED, source.aborted)
            return
        self._stats.requests_timed_out += 1
        self._tomb(rid, "lease_expired", "source blocks were released after their lease",
                   released=True)
        self._release(rid, ReleaseReason.LEASE_EXPIRED)

    def _abort(self, rid: str, reason: str) -> None:
        self._stats.requests_aborted += 1
        source = self._sources.get(rid)
        if source is not None and source.mode is TransferMode.PULL:
            # A pull ticket is out: a READ may run at any time until the lease ends, so the
            # blocks stay until the consumer is done with them or the lease is over; the
            # puller, if known, is told not to trust what it reads.
            self._tomb(rid, "aborted", reason, released=True)
            source.aborted = reason
            if source.puller is not None:
                self._tell(source.puller, m.Failed(rid, "aborted", reason))
            return
        self._tomb(rid, "aborted", reason, released=rid in self._sources)
        push = self._pushes.get(rid)
        if push is not None:
            if push.writes:  # tell the consumer now; Failed follows once they have ended
                self._tell(push.peer, m.Abort(rid, reason))
            self._end_push(rid, "aborted", ReleaseReason.ABORTED, reason)
            return
        reg = self._registrations.get(rid)
        if reg is not None:
            self._drop_registration(rid)
            self._tell(reg.peer, m.Failed(rid, "aborted", reason))
        if rid in self._sources:
            self._release(rid, ReleaseReason.ABORTED, reason)

    def _tomb(self, rid: str, code: str, reason: str, released: bool) -> None:
        """Remember an ended request (``released``: its source blocks went back already)."""
        now = time.monotonic()
        if len(self._tombstones) > 4096:  # forget the expired ones
            self._tombstones = {k: v for k, v in self._tombstones.items() if v[2] > now}
        old = self._tombstones.get(rid)
        released = released or (old is not None and old[3])  # once released, always
        self._tombstones[rid] = (code, reason, now + self.config.tombstone_s, released)

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
        self._emit(Release(rid, reason, source.ids, detail,
                           {**source.stamps, "released": time.monotonic()}))

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

    def _drop_consumer(self, peer: _Consumer, why: str) -> None:
        if self._consumers.get(peer.identity) is not peer:
            return
        log.info("%s: dropping consumer %s: %s", self.name, peer.agent_name, why)
        self._stats.peers_lost += 1
        for rid, push in list(self._pushes.items()):
            if push.peer is peer:
                self._end_push(rid, "", ReleaseReason.FAILED, f"consumer lost: {why}",
                               abandon=True)
        for rid, reg in list(self._registrations.items()):
            if reg.peer is peer:
                self._drop_registration(rid)
        for rid, source in list(self._sources.items()):
            if source.puller is peer:  # its READ died with it
                self._release(rid, ReleaseReason.FAILED, f"pulling consumer lost: {why}")
        del self._consumers[peer.identity]
        if self._by_agent.get(peer.agent_name) is peer:
            del self._by_agent[peer.agent_name]
        self._agent.remove_peer(peer.agent_name)

    def _debug_state(self, rid: str) -> str:
        """Where ``rid`` is (loop thread; for tests): writing, registered, held-push,
        held-pull, pulling or none."""
        if rid in self._pushes:
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
            self._tell(peer, m.Bye(self.name))
        for rid, push in list(self._pushes.items()):
            for write in push.writes.values():
                if not self._agent.release(write.handle):
                    log.error("%s: WRITE for %r could not be cancelled at close", self.name, rid)
                write.deadline.cancel()
                LIVE.add("transfers_in_flight", -1)
            del self._pushes[rid]
        for rid in list(self._registrations):
            self._drop_registration(rid)
        for rid in list(self._sources):
            self._release(rid, ReleaseReason.CLOSED, "producer closed")
        self._consumers.clear()
