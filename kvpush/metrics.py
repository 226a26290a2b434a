"""Counters: per-endpoint statistics, and process-wide live-resource counts.

:data:`LIVE` counts what must return to zero once every Producer and Consumer is closed --
registered layouts, transfers in flight, requests awaiting completion, source blocks held.
Tests assert it at teardown (the idea of uvloop's ``UVLOOP_DEBUG``); it is cheap enough to
keep on in every build.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

__all__ = ["LIVE", "LiveCounters", "Stats"]


class LiveCounters:
    """Thread-safe named counters of live resources."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, delta: int) -> None:
        """Add ``delta`` to counter ``name``."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + delta

    def snapshot(self) -> dict[str, int]:
        """The counters that are not zero."""
        with self._lock:
            return {k: v for k, v in self._counts.items() if v}


LIVE = LiveCounters()


@dataclass
class Stats:
    """What one Producer or Consumer has done so far (read with ``.stats()``)."""

    requests_completed: int = 0
    requests_failed: int = 0
    requests_timed_out: int = 0
    requests_aborted: int = 0
    transfers_posted: int = 0
    transfers_explicit: int = 0    # of them, posted as explicit merged descriptors
    blocks_moved: int = 0
    bytes_moved: int = 0
    descriptors_posted: int = 0
    blocks_released: int = 0
    messages_rejected: int = 0
    auth_rejected: int = 0
    checksum_mismatches: int = 0
    peers_lost: int = 0
    transfers_abandoned: int = 0   # released while NIXL still had them in progress
    results_unsafe: int = 0        # consumer: results with blocks_safe=False
    frames_queued: int = 0         # control frames ZeroMQ could not take at once (retried)
    stale_messages: int = 0        # about a use (request id, xid) that is not live here
    events_refused: int = 0        # an event the request's state does not allow
    loop_wakeups: int = 0          # the loop thread came back from a blocking wait
    hot_polls: int = 0             # loop iterations spun without releasing the GIL
    loop_stalls: int = 0           # loop iterations longer than driver.LOOP_STALL_S (logged)
    data_plane_restarts: int = 0   # data-plane child lost and started again (data_plane="child")

    def as_dict(self) -> dict[str, int]:
        """Every counter by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
