"""What an engine gets back about a request: modes, states, results, handles, releases."""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .errors import KvpushError, TransferTimeout

__all__ = [
    "Release",
    "ReleaseReason",
    "RequestState",
    "TransferHandle",
    "TransferMode",
    "TransferResult",
]


class TransferMode(enum.Enum):
    """PUSH: the producer WRITEs into blocks the consumer registered early.
    PULL: the consumer READs blocks the producer exposes after prefill."""

    PUSH = "push"
    PULL = "pull"


class RequestState(enum.Enum):
    """A consumer-side request's state. Every state but PENDING is final."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"


class ReleaseReason(enum.Enum):
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
    which use's blocks came back.

    ``blocks_safe`` False: a transfer may still *read* these blocks (the Producer closed
    with a WRITE in flight or a READ inside the hold it promised, or a WRITE was abandoned
    and its consumer could not be told). Keep their contents unchanged for
    ``quarantine_s`` seconds (the larger of the producer's ``transfer_timeout_s`` and
    ``peer_timeout_s``) before reusing them, or the consumer may receive the reuse's bytes.
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
        return self.state is RequestState.READY

    def raise_for_state(self) -> None:
        """Raise the request's error unless it is READY."""
        if self.error is not None:
            raise self.error


class TransferHandle:
    """The consumer's view of one request; :meth:`wait` blocks (with a timeout) for its
    :class:`TransferResult`. ``xid`` is the transfer id of this use of ``request_id``."""

    __slots__ = ("_event", "_result", "mode", "request_id", "xid")

    def __init__(self, request_id: str, mode: TransferMode, xid: int = 0) -> None:
        self.request_id = request_id
        self.mode = mode
        self.xid = xid
        self._event = threading.Event()
        self._result: TransferResult | None = None

    def _set(self, result: TransferResult) -> None:
        self._result = result
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def result(self) -> TransferResult | None:
        """The result, or None while the request is pending."""
        return self._result

    def wait(self, timeout: float) -> TransferResult:
        """Wait up to ``timeout`` seconds; raises :class:`~kvpush.errors.TransferTimeout` if
        the request is still pending then (the request itself goes on)."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 <= timeout < math.inf:  # also refuses NaN (it would never end)
            raise ValueError(f"wait timeout must be a finite number >= 0, got {timeout!r}")
        # Waits in slices so Ctrl-C reaches the caller.
        remaining = timeout
        while not self._event.wait(min(remaining, 0.2)):
            remaining -= 0.2
            if remaining <= 0:
                raise TransferTimeout(
                    f"request {self.request_id!r} still pending after waiting {timeout} s"
                )
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        state = self._result.state.value if self._result else "pending"
        return f"TransferHandle({self.request_id!r}, {self.mode.value}, {state})"
