"""A man in the middle of kvpush's control plane: a ZeroMQ proxy between consumers' control
sockets and one producer's, which passes, drops, delays, duplicates or answers frames by
rules, holds them all (a peer gone silent), or cuts every connection (a peer killed).

It stands where a network would: consumers dial :attr:`ControlProxy.address`, and it
dials the producer once per consumer connection under that connection's own ZeroMQ
identity, so the producer tells consumers apart as it would without it. Only control
frames pass through it; NIXL's transfers and notifications (``Landed``, ``PullDone``) go
straight between the agents.

What ZeroMQ guarantees and this proxy breaks on purpose: one connection delivers its
frames in order, each once, and loses them only at a reconnection or past the high-water
mark. A delay keeps the order (a frame delayed holds back those behind it on its
connection, as a slow link does); a drop is the loss at a reconnection; a duplicate is no
fault ZeroMQ makes (a peer's own retransmit is), and with ``auth_key`` the receiver
refuses the second copy as a replay. Frames are recognised by their message tag, readable
whether or not they are sealed (sealing authenticates, it does not hide the tag).

Rules are checked in order and the first one that matches a frame decides; each rule
draws from its own :class:`random.Random`, seeded, and only for the frames it matches, so
a rule's choices depend only on the order of the frames of its own kinds.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import math
import os
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from .. import messages as m
from .. import stream
from ..auth import COUNTER, TAG_BYTES

__all__ = ["Action", "ControlProxy", "Direction", "FrameRule", "frame_info"]

log = logging.getLogger("kvpush.testing")

#: How long :meth:`ControlProxy.reopen` retries binding the address it had (the kernel
#: frees a listening port a moment after ZeroMQ closes it).
REBIND_S = 5.0


class Direction(enum.Enum):
    """Which way a control frame travels."""

    TO_PRODUCER = "to_producer"
    TO_CONSUMER = "to_consumer"


class Action(enum.Enum):
    """What a :class:`FrameRule` does to a frame it picks.

    ``PASS`` forwards it (a rule that shields frames from the rules after it); ``DROP``
    loses it; ``DELAY`` forwards it ``delay_s`` later, and the frames behind it on its
    connection no earlier; ``DUPLICATE`` forwards it twice; ``FAIL`` (a consumer's
    ``register``, unauthenticated only) does not forward it and answers the consumer
    ``Failed`` with code "failed": the producer cannot deliver, nothing was written.
    """

    PASS = "pass"
    DROP = "drop"
    DELAY = "delay"
    DUPLICATE = "duplicate"
    FAIL = "fail"


@dataclass(frozen=True)
class FrameRule:
    """Which control frames a :class:`ControlProxy` tampers with, and how.

    Parameters
    ----------
    action
        What to do with a frame the rule picks (:class:`Action`).
    kinds
        Message tags the rule matches (``"register"``, ``"posted"``, ``"hb"``,
        ``"hb_ack"``, ``"abort"``, ``"failed"``, ``"pull_begin"``, ``"pull_held"``,
        ``"hello"``, ... as in :mod:`kvpush.messages`); empty: every kind.
    direction
        Only frames travelling this way; None: both.
    request_id
        Only frames about this request id; None: any frame.
    probability
        Chance that a matching frame is picked (drawn from the rule's own seeded RNG).
    skip
        Matching frames let through untouched before the rule starts picking.
    limit
        Most frames the rule picks; None: no limit.
    delay_s
        ``DELAY``: how long a picked frame is held.
    seed
        Seed of the rule's RNG.
    """

    action: Action
    kinds: frozenset[str] = frozenset()
    direction: Direction | None = None
    request_id: str | None = None
    probability: float = 1.0
    skip: int = 0
    limit: int | None = None
    delay_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action(self.action))
        if isinstance(self.kinds, str):
            raise TypeError("FrameRule.kinds is a set of message tags, not one string")
        object.__setattr__(self, "kinds", frozenset(self.kinds))
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"FrameRule.probability must be in [0, 1], got {self.probability}")
        if self.skip < 0 or (self.limit is not None and self.limit < 0):
            raise ValueError("FrameRule.skip and FrameRule.limit must be >= 0")
        if not 0.0 <= self.delay_s <= 3600 or (self.action is Action.DELAY
                                                 and self.delay_s == 0):
            raise ValueError(f"FrameRule.delay_s must be in (0, 3600] for DELAY and in "
                             f"[0, 3600] otherwise, got {self.delay_s}")
        if self.action is Action.FAIL and (self.kinds != {"register"}
                                           or self.direction is Direction.TO_CONSUMER):
            raise ValueError("FrameRule: FAIL answers a consumer's registration: "
                             "kinds={'register'}")

    def matches(self, direction: Direction, kind: str, request_id: str | None) -> bool:
        """Whether a frame of this direction, tag and request id is the rule's to judge."""
        return (self.direction in (None, direction) and (not self.kinds or kind in self.kinds)
                and self.request_id in (None, request_id))


class _Judge:
    """A rule with its RNG and counts."""

    def __init__(self, rule: FrameRule) -> None:
        self.rule = rule
        self.rng = random.Random(rule.seed)
        self.seen = 0
        self.picked = 0

    def pick(self) -> bool:
        self.seen += 1
        rule = self.rule
        if self.seen <= rule.skip or (rule.limit is not None and self.picked >= rule.limit):
            return False
        if rule.probability < 1.0 and self.rng.random() >= rule.probability:
            return False
        self.picked += 1
        return True


def frame_info(frame: bytes) -> tuple[str, str | None]:
    """A control frame's message tag and request id (None where it has none); ``("?",
    None)`` for a frame that is not a kvpush message of this protocol version."""
    if len(frame) < 3 or frame[0] != m.PROTOCOL_VERSION:
        return "?", None
    body = frame[2:] if not m.is_sealed(frame) else frame[2 + COUNTER.size + TAG_BYTES:]
    try:
        fields = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return "?", None
    if not isinstance(fields, dict):
        return "?", None
    kind, rid = fields.get("t", "?"), fields.get("request_id")
    return (kind if isinstance(kind, str) else "?"), (rid if isinstance(rid, str) else None)


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    direction: Direction = field(compare=False)
    identity: bytes = field(compare=False)
    frames: list[bytes] = field(compare=False)


class ControlProxy:
    """A ZeroMQ proxy in front of the producer at ``target``, run by one thread of its own.

    Parameters
    ----------
    target
        The producer's control address (``tcp://host:port``).
    host, port
        Where the proxy listens (port 0: any free port); consumers dial :attr:`address`.
    rules
        :class:`FrameRule` s, checked in order (more with :meth:`add_rule`).
    name
        For the thread's name and log lines.

    Every method may be called from any thread; each that changes what the proxy does
    waits (at most ``timeout`` seconds) until its thread has taken the change, so what
    follows the call in a test happens after it. :meth:`close` (or the context manager)
    stops the thread and closes every socket.
    """

    def __init__(self, target: str, *, host: str = "127.0.0.1", port: int = 0,
                 rules: Iterable[FrameRule] = (), name: str = "proxy",
                 control: str = "tcp") -> None:
        self.target = target
        self.name = name
        self._judges = [_Judge(r) for r in rules]
        # the endpoints' kind of control socket (TransportConfig.control)
        self._ctx: Any = stream.Context() if control == "tcp" else zmq.Context()
        self._front: zmq.Socket[Any] | None = self._bind(f"tcp://{host}:{port}", 0.0)
        self.address: str = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self._backs: dict[bytes, zmq.Socket[Any]] = {}
        self._due: list[_Due] = []           # heap of frames waiting to go
        self._tail: dict[tuple[Direction, bytes], float] = {}  # last due time per connection
        self._held: deque[tuple[Direction, bytes, list[bytes]]] = deque()
        self._holding = False
        self._seq = itertools.count()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = False
        self._lock = threading.Lock()
        #: (direction, tag, what was done) -> frames, for a test's assertions and its
        #: failure messages ("pass", "drop", "delay", "duplicate", "fail", "held", "lost").
        self.counts: Counter[tuple[Direction, str, str]] = Counter()
        self._thread = threading.Thread(target=self._run, name=f"kvpush-testing-{name}",
                                        daemon=True)
        self._thread.start()

    # -- the test's side -------------------------------------------------------------------
    def add_rule(self, rule: FrameRule, timeout: float = 5.0) -> None:
        """Check ``rule`` after the rules already there."""
        self._call(lambda: self._judges.append(_Judge(rule)), timeout)

    def clear_rules(self, timeout: float = 5.0) -> None:
        """Forget every rule: frames pass (those already delayed keep their time)."""
        self._call(self._judges.clear, timeout)

    def hold(self, timeout: float = 5.0) -> None:
        """Forward nothing, either way, until :meth:`release`: the peer behind looks
        stalled (its connections stay up, its frames wait, as in a stopped process's
        socket buffers)."""
        def hold() -> None:
            self._holding = True
        self._call(hold, timeout)

    def release(self, timeout: float = 5.0) -> None:
        """Forward what :meth:`hold` kept, in order, then go on as before."""
        def release() -> None:
            self._holding = False
            held, self._held = self._held, deque()
            for direction, identity, frames in held:
                self._forward(direction, identity, frames)
        self._call(release, timeout)

    def cut(self, timeout: float = 5.0) -> None:
        """Close every connection both ways and stop listening, losing every frame
        waiting here and ending a :meth:`hold`: to each side the other has died without a
        word (a peer's TCP connections reset, as when its process is killed). Rules stay
        (they describe the link). :meth:`reopen` listens again."""
        self._call(self._cut, timeout)

    def reopen(self, timeout: float = 5.0) -> None:
        """Listen at :attr:`address` again after :meth:`cut` (consumers' sockets
        reconnect by themselves)."""
        def reopen() -> None:
            if self._front is None:
                self._front = self._bind(self.address, REBIND_S)
        self._call(reopen, timeout)

    @property
    def is_cut(self) -> bool:
        """True between :meth:`cut` and :meth:`reopen`."""
        return self._front is None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every socket (idempotent)."""
        with self._lock:
            if self._stop:
                return
            self._stop = True
        os.eventfd_write(self._wake, 1)
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a poll that never returns
            raise RuntimeError(f"{self.name}: proxy thread did not stop in {timeout} s")
        self._cut()
        os.close(self._wake)
        self._ctx.term()

    def __enter__(self) -> ControlProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy's thread ----------------------------------------------------------------
    def _call(self, fn: Callable[[], None], timeout: float) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        with self._lock:
            if self._stop:
                raise RuntimeError(f"{self.name}: proxy closed")
            self._commands.put(run)
        os.eventfd_write(self._wake, 1)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.name}: proxy thread did not answer in {timeout} s")

    def _bind(self, address: str, retry_s: float) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                sock.bind(address)
                return sock
            except zmq.ZMQError:
                if time.monotonic() >= deadline:
                    sock.close()
                    raise
                time.sleep(0.02)

    def _back(self, identity: bytes) -> zmq.Socket[Any]:
        sock = self._backs.get(identity)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
            if not (identity.startswith(b"\0") and isinstance(sock, zmq.Socket)):
                # (ZeroMQ's own ids, which a ROUTER gives a peer without one, are reserved)
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect(self.target)
            self._backs[identity] = sock
        return sock

    def _cut(self) -> None:
        self._holding = False  # what comes back after a cut has not stalled
        if self._front is not None:
            self._front.close(0)
            self._front = None
        for sock in self._backs.values():
            sock.close(0)
        self._backs.clear()
        for due in self._due:
            self.counts[due.direction, frame_info(due.frames[-1])[0], "lost"] += 1
        self._due.clear()
        self._tail.clear()
        self._held.clear()

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop:
                sockets = ([self._front] if self._front is not None else []) \
                    + list(self._backs.values())
                for sock in sockets:
                    poller.register(sock, zmq.POLLIN)
                poller.register(self._wake, zmq.POLLIN)
                wait = None if not self._due else \
                    max(math.ceil((self._due[0].at - time.monotonic()) * 1000), 0)
                ready = dict(poller.poll(wait))
                for sock in sockets:
                    poller.unregister(sock)
                poller.unregister(self._wake)
                if self._wake in ready:
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass
                    while True:
                        try:
                            command = self._commands.get_nowait()
                        except queue.Empty:
                            break
                        command()
                if self._stop:
                    break
                for sock in sockets:
                    if not sock.closed and (sock in ready or (not isinstance(sock, zmq.Socket)
                                            and sock.fileno() in ready)):
                        self._read(sock)
                self._deliver_due()
        except Exception:  # pragma: no cover - a bug here would hang the test otherwise
            log.exception("%s: proxy thread failed", self.name)

    def _read(self, sock: zmq.Socket[Any]) -> None:
        for _ in range(256):  # a turn for the other sockets and the timers in between
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self._front:
                self._route(Direction.TO_PRODUCER, frames[0], frames[1:])
            else:
                identity = next((i for i, s in self._backs.items() if s is sock), None)
                if identity is not None:
                    self._route(Direction.TO_CONSUMER, identity, frames)

    def _route(self, direction: Direction, identity: bytes, frames: list[bytes]) -> None:
        if not frames:
            return
        if self._holding:
            self._held.append((direction, identity, frames))
            self.counts[direction, frame_info(frames[-1])[0], "held"] += 1
            return
        self._forward(direction, identity, frames)

    def _forward(self, direction: Direction, identity: bytes, frames: list[bytes]) -> None:
        kind, rid = frame_info(frames[-1])
        judge = next((j for j in self._judges if j.rule.matches(direction, kind, rid)), None)
        action = Action.PASS if judge is None or not judge.pick() else judge.rule.action
        self.counts[direction, kind, action.value] += 1
        if action is Action.DROP:
            return
        if action is Action.FAIL:
            self._fail(identity, frames[-1])
            return
        delay = judge.rule.delay_s if judge is not None and action is Action.DELAY else 0.0
        for _ in range(2 if action is Action.DUPLICATE else 1):
            self._schedule(direction, identity, frames, delay)

    def _fail(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = m.decode(frame)
        except Exception:  # sealed (FAIL needs plain frames) or malformed: lost
            log.warning("%s: cannot answer a sealed or malformed registration", self.name)
            return
        if isinstance(msg, m.Register):
            answer = m.Failed(msg.request_id, msg.xid, "failed",
                              "the simulated producer failed this transfer")
            self._schedule(Direction.TO_CONSUMER, identity, [m.encode(answer)], 0.0)

    def _schedule(self, direction: Direction, identity: bytes, frames: list[bytes],
                  delay: float) -> None:
        # Never before a frame already waiting on the same connection: ZeroMQ keeps order.
        key = (direction, identity)
        at = max(time.monotonic() + delay, self._tail.get(key, -math.inf))
        self._tail[key] = at
        heapq.heappush(self._due, _Due(at, next(self._seq), direction, identity, frames))
        self._deliver_due()

    def _deliver_due(self) -> None:
        now = time.monotonic()
        while self._due and self._due[0].at <= now:
            due = heapq.heappop(self._due)
            self._send(due.direction, due.identity, due.frames)
        if not self._due:
            self._tail.clear()

    def _send(self, direction: Direction, identity: bytes, frames: list[bytes]) -> None:
        try:
            if direction is Direction.TO_PRODUCER:
                if self._front is not None:  # not cut meanwhile
                    self._back(identity).send_multipart(frames, zmq.NOBLOCK)
            elif self._front is not None:
                self._front.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError:  # past the high-water mark: lost, as ZeroMQ would lose it
            self.counts[direction, frame_info(frames[-1])[0], "lost"] += 1
