"""The I/O driver of a Producer or a Consumer: one loop thread that owns the NIXL agent and
the control sockets, a command queue into it, timers, the progress budget, and the one place
where the effects of the role's protocol core are carried out.

Composition, not inheritance. A driver holds three parts that it calls and that call it:
the role's request core (:class:`~kvpush.protocol.producer.ProducerCore` or
:class:`~kvpush.protocol.consumer.ConsumerCore`: events in, effects out), the role's peer
sessions over ZeroMQ (:mod:`kvpush.sessions`: the session machines of
:mod:`kvpush.protocol.session` with their sockets), and the facade's ``deliver`` (a result
or a release handed to the engine). The facades (:class:`~kvpush.Producer`,
:class:`~kvpush.Consumer`) keep configuration, validation, handles and queues.

Threads. The engine's threads call the public methods; those validate their arguments on the
caller's thread (so bad input raises at once, with nothing posted), then hand a closure to the
loop through a queue and an eventfd. Everything that touches NIXL or ZeroMQ runs on the loop
thread, so neither needs locks. The loop blocks in ``zmq.Poller.poll`` when nothing is in
flight and follows :class:`~kvpush.progress.ProgressPolicy` when something is.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import zmq

from . import _trace
from . import messages as m
from ._loop import enter_loop, loop_name, no_blocking
from .agent import Agent, TransportConfig, XferState
from .auth import Opener, Sealer, new_nonce
from .dataplane import ChildAgent, make_agent
from .errors import AuthenticationError, ClosedError, KvpushError, PeerUnavailable, ProtocolError
from .layout import KVLayout
from .metrics import LIVE, Stats
from .plan import block_checksums
from .progress import Backoff, ProgressPolicy
from .protocol.effects import Abandon, Dial, DropPeer, Emit, Post, Send, XferEnd
from .protocol.timers import Timer, TimerHeap

__all__ = ["OUTBOX_BYTES", "SEND_HWM", "AgentLinks", "Core", "Driver", "LoopIO", "Sessions",
           "Timer", "close_dead_links", "control_socket"]

log = logging.getLogger("kvpush")

#: Control frames ZeroMQ queues per peer before a send would block (its high-water mark);
#: past it, frames wait in the driver's own outbox (:meth:`Driver.send_frame`).
SEND_HWM = 1 << 14
#: Bytes of control frames that may wait for one peer; past it the peer is given up
#: (its requests fail with a clear status) rather than memory growing without bound.
OUTBOX_BYTES = 64 << 20
#: Messages one socket's handler reads per loop iteration, and their bytes (a first message
#: is read whatever its size): the rest wait in ZeroMQ for the next iteration, so NIXL polls,
#: timers and the other sockets get their turn in between. A ROUTER hands its peers'
#: messages out in turn (ZeroMQ fair-queues them), so a peer that floods the socket gets
#: its share of each iteration's budget, not the whole of it.
READ_MESSAGES = 256
READ_BYTES = 64 << 20
#: Largest frame read from a peer that has not authenticated (a Hello and its NIXL metadata
#: with room to spare); a larger one is dropped unread: neither copied nor checked.
STRANGER_FRAME_BYTES = 1 << 20
#: Bytes of frames from peers that have not authenticated read per loop iteration, and per
#: such peer: past them, their frames are dropped unread (a handshake is re-sent).
STRANGER_BYTES = 4 << 20
STRANGER_PEER_BYTES = 2 * STRANGER_FRAME_BYTES
#: One loop iteration (commands, messages, NIXL polls, timers) longer than this is logged,
#: with where its time went: every request of the endpoint waited meanwhile.
LOOP_STALL_S = 0.1
#: ... at most once per this many seconds (a stream of large requests stalls each time).
STALL_LOG_EVERY_S = 10.0


def close_dead_links(sock: zmq.Socket[Any], peer_timeout_s: float) -> None:
    """Make the kernel close a control connection whose peer has gone silent: TCP keepalive
    probes once it has been idle ``peer_timeout_s`` (3 probes, 1 s apart), and a cap of
    ``peer_timeout_s`` on unacknowledged data (TCP_USER_TIMEOUT, ``ZMQ_TCP_MAXRT``). Without
    this, a connection whose FIN was lost in a link cut stays half-open for ever on the other
    side: a socket leaked per cut. (ZeroMQ's own ZMTP heartbeats would do it too, but
    libzmq 4.3 can abort the process on their timeout: zeromq/libzmq#3937, #4364.)"""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(int(peer_timeout_s), 1))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.TCP_MAXRT, max(int(peer_timeout_s * 1000), 1000))


def control_socket(sock: zmq.Socket[Any], peer_timeout_s: float) -> None:
    """Options every control socket gets: no linger, dead links closed
    (:func:`close_dead_links`), and a deliberate high-water mark (:data:`SEND_HWM`)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, SEND_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)  # refused before allocation
    close_dead_links(sock, peer_timeout_s)


def _precise_sleeps() -> None:
    """Make this thread's short sleeps last what they ask: Linux lets a sleep overrun by the
    thread's timer slack, 50 us by default, so the progress policy's 20 us sleeps would
    last several times as long. 1 us of slack for the loop thread alone
    (``PR_SET_TIMERSLACK``); elsewhere, or if refused, sleeps stay as they were."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except (OSError, AttributeError):
        pass


class AgentLinks:
    """Both cores' ``links``: plans over the agent's prepared descriptor lists (this side's
    ids first), their descriptor size, and this side's block checksums."""

    def __init__(self, agent: Agent | ChildAgent, layout: KVLayout) -> None:
        self._agent = agent
        self._layout = layout

    def plan(self, peer: str, local_ids: np.ndarray, remote_ids: np.ndarray,
             coalesce: bool) -> Any:
        lay = self._layout
        return self._agent.link(peer).plan(local_ids, remote_ids, lay.num_blocks,
                                           lay.num_regions, coalesce)

    def desc_bytes(self, peer: str) -> int:
        return self._agent.link(peer).desc_bytes

    def checksums(self, ids: np.ndarray) -> bytes:
        return bytes(block_checksums(self._layout, ids).astype("<u8").tobytes())


class Core(Protocol):
    """What the driver asks of a role's request core (both cores provide it)."""

    gauges: dict[str, int]

    def drain(self) -> list[Any]: ...
    def next_deadline(self) -> float | None: ...
    def tick(self, now: float) -> None: ...
    def transfer_ended(self, now: float, key: int, end: XferEnd,
                       inline_s: float = 0.0) -> None: ...
    def on_notification(self, now: float, peer: str, msg: m.Message,
                        since: float | None = None) -> None: ...
    def wants_notifications(self) -> bool: ...
    def quiet_until(self, now: float) -> float | None: ...
    def predicted(self, now: float, spin_s: float) -> tuple[float, float] | None: ...
    def close(self, now: float) -> None: ...


class Sessions(Protocol):
    """What the driver asks of a role's peer sessions (:mod:`kvpush.sessions`)."""

    def send(self, peer: str, msg: m.Message) -> None:
        """Send ``msg`` over connected peer ``peer``'s control connection."""

    def keys(self, peer: str) -> tuple[bool, Sealer | None, Opener | None]:
        """(whether ``peer`` is connected, its notification sealer, its opener)."""

    def forget(self, peer: str, why: str) -> None:
        """The core is done with ``peer``: its NIXL state may go."""

    def dial(self, address: str, timeout: float) -> None:
        """Connect to the peer at ``address`` (the core's Dial); the core is told how the
        handshake ended."""

    def unreachable(self, peer: str, why: str) -> None:
        """NIXL says ``peer`` is disconnected (a post failed with PeerUnavailable)."""

    def doubt(self, peer: str, now: float) -> str:
        """Why ``peer`` may have given this side up by ``now`` ("": it cannot have; a WRITE
        to it may go)."""

    def distrust(self, peer: str, why: str) -> None:
        """Drop ``peer``'s session for ``why`` (:meth:`doubt`): it is told to connect
        again."""

    def undeliverable(self, sock: zmq.Socket[Any], identity: bytes | None, why: str) -> None:
        """Frames for a peer could not be delivered (its outbox overflowed)."""

    def data_plane_lost(self, why: str) -> None:
        """The data-plane child is gone: give up every peer."""

    def data_plane_restarted(self) -> None:
        """A new data-plane child is up: handshake with the peers again."""

    def close(self) -> None:
        """The endpoint closes: say goodbye; nobody waits for a session any more."""


@dataclass(frozen=True)
class LoopIO:
    """What a driver runs on when it runs without its thread: the owner calls
    :meth:`Driver.step` whenever something may have happened (a frame arrived, a command was
    queued, a transfer ended, :meth:`Driver.next_wake` came), so a test or the simulator runs
    the production loop's code on its own clock, over its own sockets and NIXL agent."""

    clock: Callable[[], float]                 # monotonic seconds (timers, deadlines)
    wall: Callable[[], float]                  # wall-clock seconds (sealed frames' age)
    nonce: Callable[[], bytes]                 # 16 fresh bytes (handshakes, identities)
    context: Any                               # makes sockets: ``socket(zmq.ROUTER|DEALER)``
    agent: Callable[[str, KVLayout], Any]      # this endpoint's NIXL agent (Agent's methods)


class Driver:
    """The loop thread of one Producer or Consumer and what it owns (see the module).

    With ``io`` (:class:`LoopIO`) there is no thread: the owner runs each iteration."""

    def __init__(self, layout: KVLayout, *, role: str, name: str | None,
                 transport: TransportConfig, progress: ProgressPolicy,
                 auth_key: bytes | None, io: LoopIO | None = None) -> None:
        self.stats = Stats()
        self.clock: Callable[[], float] = time.monotonic if io is None else io.clock
        self.wall: Callable[[], float] = time.time if io is None else io.wall
        self.nonce: Callable[[], bytes] = new_nonce if io is None else io.nonce
        self._threaded = io is None
        self.key = auth_key
        self.layout = layout
        self.role = role
        self.name = name or f"kvpush-{role}-{uuid.uuid4().hex[:12]}"
        self.policy = progress
        self._backoff = Backoff(progress)
        self._closed = False
        self._close_lock = threading.Lock()
        # Held while a command is queued and while close() marks the endpoint closed, so no
        # command is queued after the final drain (it would never run).
        self._submit_lock = threading.Lock()
        # Who releases NIXL and the sockets when close() cannot wait for the loop thread
        self._exit_lock = threading.Lock()
        self._loop_exited = False
        self._teardown_on_exit = False
        self._finalized = False
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Requests handed in (counted under the submit lock) and fed to the core (counted
        # under _feeding, held across the feed): see :meth:`pending`.
        self._opened = 0
        self._fed = 0
        self._feeding = threading.RLock()  # re-entrant: a log handler in a feed may count
        self.timers = TimerHeap()
        self.agent: Agent | ChildAgent = make_agent(self.name, layout, transport) \
            if io is None else io.agent(self.name, layout)
        self.links = AgentLinks(self.agent, layout)   # what the role's core plans with
        # The role's parts, given by start(); until then nothing runs on a loop thread.
        self.core: Core          # set by start()
        self.sessions: Sessions  # set by start()
        self._parts = False      # whether start() gave them
        self._deliver: Callable[[Any], None] = lambda item: None
        self._ended: Callable[[], None] = lambda: None
        self._gauges: dict[str, int] = {}
        self._xfers: dict[int, Any] = {}        # core transfer key -> NIXL handle
        LIVE.add("registrations", 1)
        self.ctx: Any = zmq.Context() if io is None else io.context
        self._poller = zmq.Poller()
        # how callers wake a loop blocked in poll (a loop without a thread never blocks)
        self._wake_fd = -1
        if self._threaded:
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._poller.register(self._wake_fd, zmq.POLLIN)
        # A data-plane child's channel is readable only once the child has gone.
        self._plane_fd: int | None = None
        self._watch_data_plane()
        self._sockets: dict[zmq.Socket[Any], Callable[[zmq.Socket[Any]], None]] = {}
        # Frames ZeroMQ could not take yet, per (socket, identity), in order; retried
        # from a timer that backs off (nothing spins while a peer cannot take them).
        self._outbox: dict[tuple[zmq.Socket[Any], bytes | None], deque[bytes]] = {}
        self._outbox_bytes: dict[tuple[zmq.Socket[Any], bytes | None], int] = {}
        self._flush_timer: Timer | None = None
        self._flush_delay = 1e-3
        self.thread = threading.Thread(target=self._run, name=f"{self.name}-loop", daemon=True)
        self._stop = False
        # the loop may be blocked in poll: callers must wake it (a loop without a thread
        # never blocks: its owner steps it)
        self._waiting = self._threaded
        self._emitted = False  # a result or release went to the engine this iteration
        self._notifs_read: float | None = None  # when NIXL's notifications were last read
        # The core's next deadline as the last iteration's timers left it, for the wait
        # that follows (nothing runs in between); until known, the wait asks the core.
        self._core_due: float | None = None
        self._core_due_known = False
        self._loop_error: BaseException | None = None
        self._stall_logged = -math.inf  # when a stall was last logged
        self._stalls_unlogged = 0

    def start(self, core: Core, sessions: Sessions, deliver: Callable[[Any], None],
              ended: Callable[[], None]) -> None:
        """Start the loop thread with the role's core and sessions. ``deliver`` hands a
        result or a release to the engine (loop thread); ``ended`` runs once the last has
        been delivered, as the loop closes."""
        self.core, self.sessions, self._deliver, self._ended = core, sessions, deliver, ended
        self._parts = True
        self._gauges = dict.fromkeys(core.gauges, 0)
        if self._threaded:
            self.thread.start()

    # -- loop plumbing ---------------------------------------------------------------------
    def call_soon(self, fn: Callable[[], None], opens: int = 0) -> None:
        """Run ``fn`` on the loop thread. ``opens``: how many requests ``fn`` starts
        (through :meth:`_open`; counted by :meth:`pending` from now on)."""
        with self._submit_lock:
            if self._closed:
                raise ClosedError(f"{self.role} {self.name} is closed")
            self._opened += opens
            self._commands.put(fn)
            # Only a loop blocked in poll needs waking; otherwise it drains the queue on
            # its next iteration. Saves the engine's thread a syscall that lets go of the
            # GIL (see _run for why no command is missed).
            if self._waiting:
                os.eventfd_write(self._wake_fd, 1)
        if _trace.ON:
            _trace.stamp("queued")

    def batch(self, items: Sequence[Any],
              prepare: Callable[[Any], tuple[Any, Callable[[float], object]]]) -> list[Any]:
        """A batch call: ``prepare`` validates one item on the caller's thread and returns
        (what the caller gets for it, the core event that starts its request). An item it
        refuses with KvpushError, ValueError or TypeError gets that exception in its place;
        the others' events reach the loop thread in one hand-off, in order, each carried out
        before the next (one that raises a KvpushError is logged and does not stop the
        others)."""
        out: list[Any] = []
        feeds: list[Callable[[float], object]] = []
        for item in items:
            try:
                answer, feed = prepare(item)
            except (KvpushError, ValueError, TypeError) as exc:
                out.append(exc)
                continue
            out.append(answer)
            feeds.append(feed)
        if feeds:
            self.call_soon(lambda: self._run_batch(feeds), len(feeds))
        return out

    def _run_batch(self, feeds: list[Callable[[float], object]]) -> None:
        for feed in feeds:
            try:
                self._open(feed)
            except KvpushError as exc:
                log.warning("%s: %s", self.name, exc)

    def pending(self, held: Callable[[], int]) -> int:
        """The requests a caller has handed in and not seen end (any thread): ``held``
        counts those the core holds (the role's core's count), plus those queued for the
        loop. Exact: a request is counted once from the moment its call returns, never
        twice (the loop feeds a request and counts it fed under the lock this reads with;
        code on the loop thread reads it too, the lock being re-entrant)."""
        with self._feeding:
            return self._opened - self._fed + held()

    def _open(self, feed: Callable[[float], object]) -> None:
        """:meth:`event` for a feed that starts a request (:meth:`pending`)."""
        with self._feeding:
            try:
                feed(self.clock())
            finally:
                self._fed += 1
        self.apply()

    def on_loop(self) -> bool:
        """True on this endpoint's loop thread (inside a callback)."""
        return threading.current_thread() is self.thread

    def _no_blocking_on_loop(self, what: str) -> None:
        """A blocking call made from a callback (on any kvpush loop thread) raises at once:
        it would stall that loop, or wait for the loop that runs it (:mod:`kvpush._loop`)."""
        no_blocking(what)

    def call_and_wait(self, fn: Callable[[], Any], timeout: float,
                       what: str = "this call") -> Any:
        """Run ``fn`` on the loop thread and return its result (or raise its exception).
        On this endpoint's own loop thread ``fn`` runs at once (and always for a loop
        without a thread: its owner is the loop); on another endpoint's it raises (waiting
        would stall that loop)."""
        if self.on_loop() or not self._threaded:
            return fn()
        no_blocking(what)
        done = threading.Event()
        box: list[Any] = []

        def call() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()

        self.call_soon(call)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.role} loop did not answer within {timeout} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def add_socket(self, sock: zmq.Socket[Any],
                    handler: Callable[[zmq.Socket[Any]], None]) -> None:
        self._sockets[sock] = handler
        if self._threaded:
            self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket[Any]) -> None:
        if self._sockets.pop(sock, None) is not None and self._threaded:
            self._poller.unregister(sock)
        for key in [k for k in self._outbox if k[0] is sock]:
            self.drop_outbox(key)
        sock.close(linger=0)

    def drop_outbox(self, key: tuple[zmq.Socket[Any], bytes | None]) -> None:
        self._outbox.pop(key, None)
        self._outbox_bytes.pop(key, None)

    def at(self, deadline: float, fn: Callable[[], None]) -> Timer:
        if not math.isfinite(deadline):  # a NaN in the heap would stop every timer
            raise ValueError(f"timer deadline must be finite, got {deadline}")
        return self.timers.add(deadline, fn)

    def after(self, delay: float, fn: Callable[[], None]) -> Timer:
        return self.at(self.clock() + delay, fn)

    # -- driving the protocol core: events in, effects carried out ------------------------
    def apply(self) -> None:
        """Carry out what the core asked, in order, until it asks nothing more (carrying one
        out may feed an event back: a post NIXL refuses or finishes at once)."""
        while True:
            effects = self.core.drain()
            if not effects:
                break
            if _trace.ON:
                _trace.stamp("drained")
            for effect in effects:
                if isinstance(effect, Send):
                    self.sessions.send(effect.peer, effect.msg)
                    if _trace.ON:
                        _trace.stamp("sent")
                elif isinstance(effect, Post):
                    self._post(effect)
                elif isinstance(effect, Abandon):
                    self._abandon(effect.key)
                elif isinstance(effect, Emit):
                    self._deliver(effect.item)
                    self._emitted = True
                elif isinstance(effect, DropPeer):
                    self.sessions.forget(effect.peer, effect.why)
                elif isinstance(effect, Dial):
                    self.sessions.dial(effect.address, effect.timeout)
        for name, value in self.core.gauges.items():  # published as they change
            if value != self._gauges[name]:
                LIVE.add(name, value - self._gauges[name])
                self._gauges[name] = value

    def event(self, feed: Callable[[float], object]) -> None:
        """Feed one event to the core (loop thread), with the time now, and carry out what
        it asks."""
        feed(self.clock())
        self.apply()

    def submit(self, feed: Callable[[float], object], opens: bool = False) -> None:
        """:meth:`event` on the loop thread (any thread; raises ClosedError once closed).
        ``opens``: the feed starts a request (:meth:`pending`)."""
        if opens:
            self.call_soon(lambda: self._open(feed), 1)
        else:
            self.call_soon(lambda: self.event(feed))

    def _post(self, effect: Post) -> None:
        if _trace.ON:
            _trace.stamp("post")
        now = self.clock()
        known, sealer, _ = self.sessions.keys(effect.peer)
        doubt = self.sessions.doubt(effect.peer, now) if known else ""
        if not known or doubt:
            self.core.transfer_ended(now, effect.key, XferEnd.LOST)
            if doubt:   # it may have failed the request and reused the blocks
                self.sessions.distrust(effect.peer, doubt)
            return
        try:
            handle = self.agent.post(effect.op, effect.peer, effect.local, effect.remote,
                                      m.encode(effect.notif, sealer), effect.runs,
                                      effect.regions)
        except KvpushError as exc:
            log.warning("%s: %s", self.name, exc)
            lost = isinstance(exc, PeerUnavailable)
            self.core.transfer_ended(now, effect.key, XferEnd.LOST if lost else XferEnd.ERROR)
            if lost:
                self.sessions.unreachable(effect.peer, str(exc))
            return
        if _trace.ON:
            _trace.stamp("posted")
        self._xfers[effect.key] = handle
        LIVE.add("transfers_in_flight", 1)
        self.stats.transfers_posted += 1
        self.stats.descriptors_posted += effect.descriptors
        self.stats.transfers_explicit += self.agent.last_explicit
        # On a host UCX often finishes inside the post: the core hears that it did, and how
        # long the post took.
        self._check_xfer(effect.key, handle, max(self.clock() - now, 1e-9))

    def _check_xfer(self, key: int, handle: Any, inline_s: float = 0.0) -> bool:
        """Report a transfer that ended (``inline_s``: checked right after its post, which
        took that long); True if it had."""
        state = self.agent.state(handle)
        if state is XferState.IN_PROGRESS:
            return False
        if _trace.ON:
            _trace.stamp("xfer_end")
        self.agent.release(handle)
        self._end_xfer(key, XferEnd.DONE if state is XferState.DONE else XferEnd.ERROR,
                       inline_s)
        return True

    def _abandon(self, key: int) -> None:
        """Give up a transfer without waiting for its end (its deadline passed, or its peer
        is gone): NIXL's release does not stop its bytes, so the core hears ABANDONED if it
        was still in progress. If NIXL refuses the release, it stays polled and is reported
        when it ends."""
        handle = self._xfers.get(key)
        if handle is None:
            return
        state = self.agent.state(handle)
        if not self.agent.release(handle):
            log.warning("%s: NIXL refused to release a transfer; still polling it", self.name)
            return
        self._end_xfer(key, {XferState.IN_PROGRESS: XferEnd.ABANDONED,
                             XferState.DONE: XferEnd.DONE}.get(state, XferEnd.ERROR))

    def _end_xfer(self, key: int, end: XferEnd, inline_s: float = 0.0) -> None:
        del self._xfers[key]
        LIVE.add("transfers_in_flight", -1)
        self.core.transfer_ended(self.clock(), key, end, inline_s)

    def _release_xfers(self) -> None:
        """At close: release every transfer handle (the core is told by its close())."""
        for key, handle in list(self._xfers.items()):
            if not self.agent.release(handle):
                log.error("%s: a transfer could not be released at close", self.name)
            del self._xfers[key]
            LIVE.add("transfers_in_flight", -1)

    def _busy(self) -> bool:
        """True while something is in flight that only polling NIXL will finish."""
        return bool(self._xfers) or self.core.wants_notifications()

    def _poll_transfers(self, wants: bool) -> bool:
        """Poll NIXL (transfer states, notifications); True when anything moved.
        ``wants``: the core's ``wants_notifications`` just before (asked again only if a
        transfer's end reached the core meanwhile)."""
        if _trace.ON:
            _trace.stamp("poll")
        moved = False
        for key, handle in list(self._xfers.items()):
            moved |= self._check_xfer(key, handle)
        if self.core.wants_notifications() if moved else wants:
            since, self._notifs_read = self._notifs_read, self.clock()
            for sender, msg in self._notifications():
                if _trace.ON:
                    _trace.stamp("notif")
                moved = True
                self.core.on_notification(self.clock(), sender, msg, since)
        if moved:
            self.apply()
        return moved

    def _notifications(self) -> list[tuple[str, m.Message]]:
        """New NIXL notifications (this also progresses the agent), decoded and, with a
        key, authenticated; rejects are counted, never returned. Commands queued before they
        were received have run (see :meth:`read_frames`)."""
        out: list[tuple[str, m.Message]] = []
        notifs = self.agent.notifications()
        self._drain_commands()
        for sender, notes in notifs.items():
            known, _, opener = self.sessions.keys(sender)
            for note in notes:
                try:
                    if self.key is not None and not known:
                        raise AuthenticationError(f"notification from unknown agent {sender!r}")
                    out.append((sender, m.decode(note, opener)))
                except AuthenticationError:
                    self.stats.auth_rejected += 1
                except ProtocolError:
                    self.stats.messages_rejected += 1
        return out

    def _next_timeout(self) -> float | None:
        now = self.clock()
        timeout: float | None = None
        if self._busy():
            # Quiet only while no transfer of this side's own is in flight: its bytes may
            # need this side's progress.
            timeout = self._backoff.next_delay(
                self.core.predicted(now, self.policy.spin_s),
                None if self._xfers else self.core.quiet_until(now))
        due = self._first_due(self._core_due if self._core_due_known
                              else self.core.next_deadline())
        self._core_due_known = False
        if due is not None:
            until = max(0.0, due - now)
            timeout = until if timeout is None else min(timeout, until)
        return timeout

    def _run(self) -> None:
        wake_pending = False  # the eventfd was seen readable and not read yet
        _precise_sleeps()
        enter_loop(self.name)
        try:
            while not self._stop:
                timeout = self._next_timeout()
                if timeout == 0.0 and not self._emitted:
                    # Spinning: poll without giving up the GIL. A zero-timeout zmq poll
                    # or an eventfd read drops it, and with a busy Python thread in the
                    # engine taking it back can wait a whole switch interval (5 ms).
                    # Not right after a result or release went to the engine, though: a
                    # thread of the engine woken by it must get the GIL now, not after
                    # the spin (the zero-timeout poll below lets it).
                    self._hot_iteration()
                    continue
                self._emitted = False
                if timeout and self._xfers and self._backoff.keep_polling():
                    # Bytes in flight: keep NIXL progressed, every min_sleep_s rather than
                    # at growing intervals. A real sleep, not a zero-timeout poll: an
                    # engine thread waiting for the GIL needs more than a release and an
                    # immediate retake to win it (it would wait out a switch interval).
                    timeout = min(timeout, self.policy.min_sleep_s)
                if timeout is not None and 0 < timeout < 1e-3:
                    # zmq's poll counts whole milliseconds; short waits sleep instead.
                    time.sleep(timeout)
                    timeout = 0.0
                # Callers wake a waiting loop through the eventfd. The flag is raised
                # before the queue is checked: a command queued after the check sees it
                # raised and writes the eventfd; one queued before it is found here.
                self._waiting = True
                if not self._commands.empty():
                    timeout = 0.0
                if wake_pending and timeout != 0.0:
                    # Reset the eventfd only now, about to block: the read lets go of the
                    # GIL, which right after a wake-up would put the engine's threads
                    # between the wake-up and the command it brought.
                    wake_pending = False
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                    if not self._commands.empty():
                        timeout = 0.0
                events = dict(self._poller.poll(None if timeout is None
                                                else int(timeout * 1e3)))
                self._waiting = False
                woke = self.clock()
                self.stats.loop_wakeups += 1
                if _trace.ON:
                    _trace.stamp("woke")
                if events.pop(self._wake_fd, 0):
                    wake_pending = True
                if self._plane_fd is not None and events.pop(self._plane_fd, 0):
                    self._check_data_plane()
                self._drain_commands()
                commands = self.clock()
                for sock in list(events):
                    handler = self._sockets.get(sock)
                    if handler is not None:
                        if _trace.ON:
                            _trace.stamp("message")
                        handler(sock)
                self._finish_iteration(woke, commands, self.clock())
        except BaseException as exc:  # a bug: record it, fail everything, never hang callers
            log.exception("%s loop crashed", self.name)
            self._loop_error = exc
        finally:
            with self._submit_lock:
                self._closed = True
            try:
                self._drain_commands()
                self._on_close()
            except Exception:
                log.exception("%s: error while closing", self.name)
            with self._exit_lock:
                self._loop_exited = True
                late = self._teardown_on_exit
            if late:  # close() could not wait for this thread
                self._teardown()

    def _stalled(self, took: float, parts: tuple[tuple[str, float], ...]) -> None:
        """One loop iteration took ``took`` s (past :data:`LOOP_STALL_S`): say where (at
        most one line per :data:`STALL_LOG_EVERY_S`, naming how many were not logged)."""
        self.stats.loop_stalls += 1
        now = self.clock()
        if now < self._stall_logged + STALL_LOG_EVERY_S:
            self._stalls_unlogged += 1
            return
        more = f"; {self._stalls_unlogged} more since the last such line" \
            if self._stalls_unlogged else ""
        self._stall_logged, self._stalls_unlogged = now, 0
        log.warning("%s: one loop iteration took %.3f s (%s): its requests waited "
                    "meanwhile%s", self.name, took,
                    ", ".join(f"{what} {s:.3f} s" for what, s in parts), more)

    def _hot_iteration(self) -> None:
        """One loop iteration that never releases the GIL (see :meth:`step`)."""
        self.stats.hot_polls += 1
        self.step()

    def step(self) -> None:
        """One loop iteration that never blocks: commands straight from the queue (the
        eventfd stays set and is read by the next blocking poll), sockets by their
        ``EVENTS`` option, then NIXL and the timers, as :meth:`_run` does. The loop thread
        runs it while it spins; a loop without a thread (:class:`LoopIO`) runs only it."""
        start = self.clock()
        self._drain_commands()
        commands = self.clock()
        self.read_waiting()
        self._finish_iteration(start, commands, self.clock())

    def _finish_iteration(self, start: float, commands: float, messages: float) -> None:
        """An iteration's end: NIXL polled (while anything is in flight), the timers run.
        One that took past :data:`LOOP_STALL_S` since ``start`` is reported with its parts
        (commands until ``commands``, messages until ``messages``)."""
        wants = self.core.wants_notifications()
        if (self._xfers or wants) and self._poll_transfers(wants):
            self._backoff.progressed()
        polled = self.clock()
        self._run_timers()
        done = self.clock()
        if done - start > LOOP_STALL_S:
            self._stalled(done - start, (("commands", commands - start),
                                         ("messages", messages - commands),
                                         ("NIXL polls", polled - messages),
                                         ("timers", done - polled)))

    def next_wake(self) -> float | None:
        """When the loop next has work of its own (a timer, the core's deadline), on its
        clock; None: only a command, a frame or a transfer's end brings work. Transfers in
        flight are polled by every :meth:`step` (:meth:`busy` says whether any are)."""
        return self._first_due(self.core.next_deadline() if self._parts else None)

    def _first_due(self, core_due: float | None) -> float | None:
        """The earlier of the next timer and ``core_due`` (the core's next deadline)."""
        first = self.timers.next_deadline()
        if first is None or core_due is None:
            return core_due if first is None else first
        return min(first, core_due)

    @property
    def in_flight(self) -> int:
        """Transfers posted whose end the core has not been told yet."""
        return len(self._xfers)

    def busy(self) -> bool:
        """True while a transfer or an awaited notification needs NIXL polled."""
        return self._busy()

    def read_waiting(self) -> None:
        """Handle every message already waiting on this endpoint's sockets (their ``EVENTS``
        option; no poll, so the GIL is kept). A liveness check runs it before it judges a
        peer silent: after this loop thread stalled (a long NIXL or UCX call, the GIL, the
        process stopped), the peer's answers can sit unread in the socket, and the loop
        runs its timers before it polls again."""
        for sock, handler in list(self._sockets.items()):
            if sock in self._sockets and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                if _trace.ON:
                    _trace.stamp("message")
                handler(sock)

    # -- a contained data plane (TransportConfig.data_plane="child") ------------------------
    def _watch_data_plane(self) -> None:
        fd = self.agent.fileno() if isinstance(self.agent, ChildAgent) else -1
        if self._plane_fd is not None:
            self._poller.unregister(self._plane_fd)
            self._plane_fd = None
        if fd >= 0:
            self._plane_fd = fd
            self._poller.register(fd, zmq.POLLIN)

    def _check_data_plane(self) -> None:
        why = self.agent.check() if isinstance(self.agent, ChildAgent) else None
        if why is not None:
            self._data_plane_lost(why)

    def _data_plane_lost(self, why: str) -> None:
        """The data-plane child is gone: every peer's requests fail (transfers in flight
        as not fenced), a new child registers the memory again, and the handshakes are
        made again (the sessions' ``data_plane_lost`` and ``data_plane_restarted``)."""
        self.stats.data_plane_restarts += 1
        log.warning("%s: data plane lost (%s): failing its requests and restarting it",
                    self.name, why)
        if self._plane_fd is not None:
            self._poller.unregister(self._plane_fd)
            self._plane_fd = None
        self.sessions.data_plane_lost(f"data plane lost: {why}")
        for key in list(self._xfers):  # any the core has not given up: not fenced
            self._end_xfer(key, XferEnd.ABANDONED)
        self.apply()
        self._restart_data_plane(0.05)

    def _restart_data_plane(self, delay: float) -> None:
        # a ChildAgent (or the simulator's agent, whose child is simulated)
        restart = getattr(self.agent, "restart", None)
        if self._stop or restart is None:
            return
        try:
            restart()
        except Exception as exc:
            log.error("%s: data plane did not restart (%s); retrying in %.2f s", self.name,
                      exc, delay)
            self.after(delay, lambda: self._restart_data_plane(min(delay * 2, 5.0)))
            return
        log.warning("%s: data plane restarted (pid %s)", self.name,
                    getattr(self.agent, "pid", None))
        self._watch_data_plane()
        self.sessions.data_plane_restarted()

    def _drain_commands(self) -> None:
        # Called on every receive and poll (see read_frames): an empty queue costs one
        # empty() (~50 ns), not a raised queue.Empty (~700 ns). Only this thread takes.
        while not self._commands.empty():
            fn = self._commands.get_nowait()
            if _trace.ON:
                _trace.stamp("command")
            try:
                fn()
            except KvpushError as exc:
                log.warning("%s: %s", self.name, exc)
            self._backoff.progressed()

    def _run_timers(self) -> None:
        now = self.clock()
        for fn in self.timers.pop_due(now):
            fn()
        due = self.core.next_deadline()
        if due is not None and due <= now:  # the core's own deadlines
            self.core.tick(now)
            self.apply()
            due = self.core.next_deadline()
        self._core_due, self._core_due_known = due, True

    def read_frames(self, sock: zmq.Socket[Any]) -> Iterator[list[zmq.Frame]]:
        """The messages waiting on ``sock``, read one at a time (not copied: a frame
        dropped unread costs nothing) up to this iteration's budget (:data:`READ_MESSAGES`,
        :data:`READ_BYTES`); the rest stay in ZeroMQ for the next iteration. Before each
        is handed out, the commands queued before it was received run: a message can be
        caused by a command's effect (a pull ticket leaves ``prefill_done`` before the loop
        runs the hold that call queued; its PullBegin can be here in the same iteration),
        and running the queue after receiving means a message never finds that effect
        missing. Stops once the socket was closed meanwhile (its peer given up)."""
        count = nbytes = 0
        while count < READ_MESSAGES and nbytes < READ_BYTES and not sock.closed:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            count += 1
            for frame in frames:
                nbytes += len(frame)
            self._drain_commands()
            yield frames

    # -- lifecycle -------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the loop thread, fail requests still in flight with
        :class:`~kvpush.errors.ClosedError`, and release every NIXL registration."""
        with self._close_lock:
            if self._finalized:
                return
            self._finalized = True
        with self._submit_lock:  # from here on a call raises ClosedError, never queues
            self._closed = True
        if self.on_loop() and self._threaded:
            # From a callback: the loop ends after it and tears down on its way out.
            with self._exit_lock:
                self._teardown_on_exit = True
            self._stop = True
            return
        if loop_name() is not None and self.thread.is_alive():
            # From another endpoint's callback: joining this loop would stall that one, so
            # this loop is told to stop and tears down on its way out (the wake-up is
            # written under the lock its exit takes: the fd is still open).
            with self._exit_lock:
                exited = self._loop_exited
                self._teardown_on_exit = not exited
                if not exited:
                    self._stop = True
                    os.eventfd_write(self._wake_fd, 1)
            if exited:
                self._teardown()
            return
        if self.thread.is_alive():
            self._stop = True
            os.eventfd_write(self._wake_fd, 1)
            self.thread.join(timeout)
            if self.thread.is_alive():
                # Never touch NIXL or the sockets beside a live loop: it tears down itself
                # once it stops.
                log.error("%s: loop thread did not stop within %s s; it will release "
                          "everything when it does", self.name, timeout)
                with self._exit_lock:
                    exited = self._loop_exited
                    self._teardown_on_exit = not exited
                if exited:  # it ended meanwhile
                    self._teardown()
                return
        # Commands queued before the close, or a loop that never started: end them here.
        self._drain_commands()
        self._on_close()
        self._teardown()

    def abandon(self) -> None:
        """A loop without a thread whose process dies: it stops where it is, says no
        goodbye and tells the core nothing; its sockets close and NIXL lets go."""
        if self._threaded:
            raise RuntimeError("abandon() is for a loop without a thread (LoopIO)")
        with self._close_lock:
            if self._finalized:
                return
            self._finalized = True
        with self._submit_lock:
            self._closed = True
        self._stop = True
        self._teardown()

    def _on_close(self) -> None:
        """On the loop thread as it exits (or in close() when it never ran): the sessions
        say goodbye, the core ends every request (its last results or releases are
        delivered, transfers it gives up are released), what NIXL still holds is released,
        and the facade's queues end."""
        if not self._parts:
            return
        self.sessions.close()
        self.core.close(self.clock())
        self.apply()
        self._release_xfers()
        self.apply()
        self._ended()

    def _teardown(self) -> None:
        with self._close_lock:
            if getattr(self, "_torn_down", False):
                return
            self._torn_down = True
        for sock in list(self._sockets):
            self.remove_socket(sock)
        self.agent.close()
        LIVE.add("registrations", -1)
        self.ctx.destroy(linger=0)
        if self._wake_fd >= 0:
            os.close(self._wake_fd)

    @property
    def closed(self) -> bool:
        """True once close() began (calls then raise ClosedError)."""
        return self._closed

    @property
    def finalized(self) -> bool:
        """True once close() was called (whatever it could finish)."""
        return self._finalized

    # -- control frames: delivered, or their loss known -------------------------------------
    def send_frame(self, sock: zmq.Socket[Any], frame: bytes,
                    identity: bytes | None = None) -> None:
        key = (sock, identity)
        if key not in self._outbox and self.try_send(sock, frame, identity):
            return
        box = self._outbox.setdefault(key, deque())
        box.append(frame)
        self._outbox_bytes[key] = self._outbox_bytes.get(key, 0) + len(frame)
        self.stats.frames_queued += 1
        if self._outbox_bytes[key] > OUTBOX_BYTES:
            self.drop_outbox(key)
            self.sessions.undeliverable(sock, identity, f"more than {OUTBOX_BYTES} bytes of "
                                        f"control frames could not be delivered")
            return
        if self._flush_timer is None:
            self._flush_delay = 1e-3
            self._flush_timer = self.after(self._flush_delay, self._flush)

    def queued(self, sock: zmq.Socket[Any], identity: bytes | None = None) -> bool:
        """True while control frames to ``sock`` (``identity``: one connection of a
        ROUTER) wait in the outbox."""
        return (sock, identity) in self._outbox

    def try_send(self, sock: zmq.Socket[Any], frame: bytes, identity: bytes | None) -> bool:
        try:
            if identity is None:
                sock.send(frame, zmq.NOBLOCK)
            else:
                sock.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: not connected right now
                return False
            raise
        return True

    def _flush(self) -> None:
        self._flush_timer = None
        for key, box in list(self._outbox.items()):
            sock, identity = key
            while box and self.try_send(sock, box[0], identity):
                self._outbox_bytes[key] -= len(box.popleft())
            if not box:
                self.drop_outbox(key)
        if self._outbox:
            self._flush_delay = min(self._flush_delay * 2, 0.05)
            self._flush_timer = self.after(self._flush_delay, self._flush)
