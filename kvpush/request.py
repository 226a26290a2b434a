"""What an engine gets back about a request: modes, states, results, handles, releases."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from ._enum import IdentityEnum
from ._loop import no_blocking
from .errors import KvpushError, TransferTimeout

__all__ = [
    "ConnectHandle",
    "ConnectResult",
    "OwnerStatus",
    "Release",
    "ReleaseReason",
    "RequestState",
    "RequestStatus",
    "TransferHandle",
    "TransferMode",
    "TransferResult",
]

log = logging.getLogger("kvpush")


class TransferMode(IdentityEnum):
    """PUSH: the producer WRITEs into blocks the consumer registered early.
    PULL: the consumer READs blocks the producer exposes after prefill."""

    PUSH = "push"
    PULL = "pull"


class RequestState(IdentityEnum):
    """A consumer-side request's state. Every state but PENDING is final."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"


class ReleaseReason(IdentityEnum):
    """Why the producer hands source blocks back to the engine."""

    TRANSFERRED = "transferred"
    ABORTED = "aborted"
    LEASE_EXPIRED = "lease_expired"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(frozen=True)
class Release:
    """Source blocks the engine may free or reuse now (delivered exactly once per request).

    ``timings`` holds :func:`time.monotonic` stamps of the request's stages on the producer,
    for latency breakdowns: ``prefill_done`` (the engine's call), ``held`` (kvpush's loop
    took the blocks), ``registered`` (push: the consumer's registration reached the loop;
    often before ``prefill_done``), ``posted`` (push: the first WRITE handed to NIXL,
    planning done), ``written`` (push: the last WRITE seen done), ``pull_begin`` (pull: the
    consumer announced its READ), ``released``. A stage that did not happen is absent.

    ``sid`` names the use of ``request_id`` these blocks belong to (the source id of its
    ``prefill_done``, also in its pull ticket), so an engine that reuses request ids can tell
    which use's blocks came back. ``mode`` is the one its ``prefill_done`` named, ``xids``
    the transfer ids of the consumer uses the source served (each consumer's
    ``TransferHandle.xid``; empty if none came), ascending.

    ``blocks_safe`` False: a transfer may still *read* these blocks (the Producer closed
    with a WRITE in flight or a READ inside the hold it promised, or a WRITE was abandoned
    and its consumer could not be told). Keep their contents unchanged for
    ``quarantine_s`` seconds (the larger of the producer's ``transfer_timeout_s`` and twice
    its ``peer_timeout_s``) before reusing them, or the consumer may receive the reuse's
    bytes.
    Consumers' ``peer_timeout_s`` must not exceed the producer's for that to hold.
    """

    request_id: str
    reason: ReleaseReason
    block_ids: np.ndarray
    detail: str = ""
    timings: Mapping[str, float] = field(default_factory=dict)
    sid: int = 0
    blocks_safe: bool = True
    quarantine_s: float = 0.0
    mode: TransferMode | None = None
    xids: tuple[int, ...] = ()


@dataclass(frozen=True)
class OwnerStatus:
    """One consumer use a producer-side source serves (see :class:`RequestStatus`):
    the consumer endpoint's NIXL agent name, the use's transfer id, its mode, and where it
    is: ``registered`` (push, waiting for the source), ``writing``, ``claimed``,
    ``pulling``, ``fencing`` (an abandoned WRITE awaits the consumer's word), ``done``,
    ``gone``."""

    peer: str
    xid: int
    mode: TransferMode
    state: str


@dataclass(frozen=True)
class RequestStatus:
    """A snapshot of one request id's live use on one endpoint (``Producer.status`` /
    ``Consumer.status``), taken on the loop thread; it does not change afterwards.

    ``phase`` -- consumer: ``connecting`` (a pull in its handshake), ``claiming`` (a
    :meth:`~kvpush.Consumer.claim` in its producers' handshakes), ``claimed`` (a claim
    sent, not pulled yet), ``pushing``, ``pulling``,
    ``push_closing`` / ``pull_closing`` (ending without success, waiting until nothing can
    land), or ``none`` (no live use: finished, or never seen). Producer: ``waiting``
    (registrations, no source yet), ``partial`` (layer-wise, some layers done), ``held``
    (source held for its owners), ``ending`` (released once the transfers reading it end),
    ``released_early``, ``ended``, ``aborted_early`` (tombstones: the id's last use is
    over and a late message about it is answered) or ``none``.

    ``xid`` is the consumer use's transfer id (0 on the producer: see ``owners``), ``sid``
    the producer's source use (0 where none). ``parts`` / ``parts_landed``: consumer, the
    (producer, layer group) parts the use waits for and those whose data landed; producer,
    the owners the source serves and those done. ``deadline`` is the
    :func:`time.monotonic` time the next bound falls (consumer: the request's timeout, its
    abort grace once closing, or when a claiming claim is given up; producer: the lease of
    a held source, else the earliest registration wait), None if none. ``bytes_moved``:
    bytes landed so far (consumer).
    """

    request_id: str
    phase: str
    mode: TransferMode | None = None
    xid: int = 0
    sid: int = 0
    block_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64),
                                  compare=False)
    parts: int = 0
    parts_landed: int = 0
    deadline: float | None = None
    bytes_moved: int = 0
    owners: tuple[OwnerStatus, ...] = ()

    @property
    def live(self) -> bool:
        """True while the id has a use here that has not ended."""
        return self.phase not in ("none", "ended", "released_early", "aborted_early")


@dataclass(frozen=True)
class TransferResult:
    """The final outcome of a consumer-side request.

    Delivered once, after the transfer has ended: READY only when every byte has landed;
    in every other state the request's WRITEs (push) or READs (pull) have ended too, which
    kvpush learns from NIXL itself (the WRITE's notification arriving behind its bytes, a
    READ polled to done or error), never from a cancel: NIXL's release of a transfer in
    progress does not stop its bytes.

    ``blocks_safe`` is False only when that could not be established within the bounds
    (``ConsumerConfig.abort_grace_s`` after an abort or timeout; a producer lost or a WRITE
    abandoned with a transfer in flight, e.g. a link cut). Bytes of that request may then
    still land in its destination blocks at any later time: do not hand those blocks to
    another request (quarantine them; :meth:`Consumer.stats` counts such results as
    ``results_unsafe``).

    ``block_ids`` are the destination blocks the request named (an empty array for a
    request refused before it had any), ``xid`` the transfer id of this use of
    ``request_id`` (see :mod:`kvpush.messages`; also ``TransferHandle.xid``): a result
    whose ``xid`` is not the one of the engine's live use (e.g. the FAILED result of a
    duplicate ``expect`` for a pending id) is about another use and its blocks.
    """

    request_id: str
    state: RequestState
    mode: TransferMode
    error: KvpushError | None
    elapsed_s: float
    bytes_moved: int
    blocks_safe: bool = True
    block_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64),
                                  compare=False)
    xid: int = 0

    @property
    def ok(self) -> bool:
        """True when the request is READY."""
        return self.state is RequestState.READY

    def raise_for_state(self) -> None:
        """Raise the request's error unless it is READY."""
        if self.error is not None:
            raise self.error


_T = TypeVar("_T")


class _Handle(Generic[_T]):
    """What :class:`TransferHandle` and :class:`ConnectHandle` share: an outcome set once by
    the loop thread, waited for by a thread (:meth:`wait`), an event loop (``await``) or a
    callback (:meth:`add_done_callback`). No thread is started per handle."""

    __slots__ = ("__weakref__", "_callbacks", "_event", "_lock", "_result")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result: _T | None = None
        self._callbacks: list[Callable[[Any], None]] | None = []

    def _set(self, result: _T) -> None:
        """(Loop thread.) Set the outcome once and run the done callbacks."""
        with self._lock:
            if self._callbacks is None:
                return
            self._result = result
            callbacks, self._callbacks = self._callbacks, None
            self._event.set()
        for fn in callbacks:
            self._run_callback(fn)

    def _run_callback(self, fn: Callable[[Any], None]) -> None:
        try:
            fn(self)
        except Exception:
            log.exception("a done callback of %r raised", self)

    def done(self) -> bool:
        """True once the outcome is known (never blocks)."""
        return self._event.is_set()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once the outcome is known: at once, on the calling thread,
        if it already is, else on the endpoint's loop thread (the callback rules of
        ``on_finished`` apply: keep it short, and no blocking kvpush call in it)."""
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        self._run_callback(fn)

    def _wait(self, timeout: float, what: str) -> _T:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 <= timeout < math.inf:  # also refuses NaN (it would never end)
            raise ValueError(f"wait timeout must be a finite number >= 0, got {timeout!r}")
        no_blocking(f"{type(self).__name__}.wait()")
        # Waits in slices so Ctrl-C reaches the caller.
        remaining = timeout
        while not self._event.wait(min(remaining, 0.2)):
            remaining -= 0.2
            if remaining <= 0:
                raise TransferTimeout(f"{what} still pending after waiting {timeout} s")
        assert self._result is not None
        return self._result

    def _future(self) -> asyncio.Future[_T]:
        """A future of the running event loop, resolved through the loop's own thread-safe
        wake-up (``call_soon_threadsafe``) when the outcome is known."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()

        def resolve(_: object) -> None:
            try:
                loop.call_soon_threadsafe(self._resolve, future)
            except RuntimeError:  # that event loop is closed: nobody awaits any more
                pass

        self.add_done_callback(resolve)
        return future

    def _resolve(self, future: asyncio.Future[_T]) -> None:
        if not future.done():
            assert self._result is not None
            future.set_result(self._result)


class TransferHandle(_Handle[TransferResult]):
    """The consumer's view of one request: :meth:`wait` blocks (with a timeout) for its
    :class:`TransferResult`, ``await handle`` returns it in a coroutine (stock asyncio loop
    or uvloop; the request's own deadline bounds the wait), :meth:`add_done_callback` calls
    back with the handle. ``xid`` is the transfer id of this use of ``request_id``.

    Any thread may call every method; ``wait`` raises RuntimeError on a kvpush loop thread
    (inside a callback), where it would stall the loop that has to finish it."""

    __slots__ = ("mode", "request_id", "xid")

    def __init__(self, request_id: str, mode: TransferMode, xid: int = 0) -> None:
        super().__init__()
        self.request_id = request_id
        self.mode = mode
        self.xid = xid

    @property
    def result(self) -> TransferResult | None:
        """The result, or None while the request is pending."""
        return self._result

    def wait(self, timeout: float) -> TransferResult:
        """Wait up to ``timeout`` seconds; raises :class:`~kvpush.errors.TransferTimeout` if
        the request is still pending then (the request itself goes on)."""
        return self._wait(timeout, f"request {self.request_id!r}")

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self._future().__await__()

    def __repr__(self) -> str:
        state = self._result.state.value if self._result else "pending"
        return f"TransferHandle({self.request_id!r}, {self.mode.value}, {state})"


@dataclass(frozen=True)
class ConnectResult:
    """How a handshake ended: ``name`` of the producer (the connection is up), or
    ``error`` (:class:`~kvpush.errors.PeerUnavailable`, ``LayoutMismatch``,
    ``AuthenticationError``, ``ClosedError``)."""

    address: str
    name: str | None
    error: KvpushError | None

    @property
    def ok(self) -> bool:
        """True when the handshake succeeded."""
        return self.error is None

    def raise_for_state(self) -> str:
        """The producer's name, or raise the handshake's error."""
        if self.error is not None:
            raise self.error
        assert self.name is not None
        return self.name


class ConnectHandle(_Handle[ConnectResult]):
    """A handshake in progress (:meth:`kvpush.Consumer.connect_nowait`): ``await handle``
    returns the producer's name or raises the handshake's error; :meth:`wait` does the same
    on a thread (not on a kvpush loop thread); :attr:`result` is the
    :class:`ConnectResult` once done. The handshake's own deadline
    (``connect_timeout_s`` or the timeout given) bounds every wait."""

    __slots__ = ("address",)

    def __init__(self, address: str) -> None:
        super().__init__()
        self.address = address

    @property
    def result(self) -> ConnectResult | None:
        """The outcome, or None while the handshake is in progress."""
        return self._result

    def wait(self, timeout: float) -> str:
        """Wait up to ``timeout`` seconds for the handshake; returns the producer's name or
        raises its error (:class:`~kvpush.errors.TransferTimeout` if still in progress)."""
        return self._wait(timeout, f"handshake with {self.address}").raise_for_state()

    async def _name(self) -> str:
        return (await self._future()).raise_for_state()

    def __await__(self) -> Generator[Any, None, str]:
        return self._name().__await__()

    def __repr__(self) -> str:
        if self._result is None:
            return f"ConnectHandle({self.address!r}, pending)"
        return f"ConnectHandle({self.address!r}, {self._result.name or self._result.error})"
