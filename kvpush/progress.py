"""How a kvpush loop spends CPU while transfers are in flight.

NIXL's own progress thread polls without pause (about a core per agent, idle or not), so
kvpush turns it off and drives progress from its one loop thread:

* nothing in flight: the loop blocks in ``zmq.Poller.poll`` on its sockets and a wake-up
  eventfd -- no polling at all, 0 % CPU;
* right after something moved (a command from the engine, a transfer's end, a
  notification; not a control message): poll back-to-back for ``spin_s`` (lowest latency
  for the next completion), without letting go of the GIL;
* while a transfer this side posted is in flight (its bytes may need this side's progress
  to move: UCX drives a large transfer from the initiator's progress calls), keep polling
  NIXL every ``min_sleep_s`` for up to ``inflight_s`` since the last progress, instead of
  backing off (real sleeps: an engine thread that wants the GIL gets it in between; the
  loop thread's timer slack is 1 us, so a 20 us sleep lasts about that);
* then back off in proportion: sleep ``sleep_fraction`` of the time since the last
  progress, between ``min_sleep_s`` and ``max_sleep_s``. A completion is then noticed at
  most that fraction late (about 12 % by default), however long the transfer, while a long
  transfer costs only a few polls per millisecond;
* when the loop can predict a completion (each side learns how long the transfers it waits
  for take, by size class, from when it heard of one -- a push's ``Posted`` hint, a pull's
  ``PullBegin`` -- to its notification, each landing placed in the middle of the last look
  without it and the look that found it), it wakes at the predicted moment and polls
  ``window_polls`` times (at least ``min_sleep_s`` apart) through a quarter of the
  predicted duration (at least ``spin_s``): a completion on time is noticed at once or
  1/64 of its time late at most, an early or late one no later than without the
  prediction;
* when, besides, every transfer awaited moves its bytes without this side's progress (the
  initiator's transfers of that size to this peer end inside their post: UCX over shared
  memory or CMA; it says how long they take in the hint), each is predicted to take 2 ms or
  more, and this side has none of its own in flight, nothing is polled before the
  predicted moment (at most the hint's time after it): the loop sleeps to it.

Two presets: :meth:`ProgressPolicy.latency_first` (short sleeps, longer spin) and
:meth:`ProgressPolicy.cpu_first` (no spin, longer sleeps). The default sits between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Backoff", "ProgressPolicy"]


@dataclass(frozen=True)
class ProgressPolicy:
    """Polling budget while transfers are in flight.

    Parameters
    ----------
    spin_s
        Seconds of back-to-back polling after any progress.
    min_sleep_s
        Shortest sleep once spinning ends.
    max_sleep_s
        Longest sleep; bounds the latency added to a completion.
    sleep_fraction
        Each sleep is this fraction of the time since the last progress (clamped).
    inflight_s
        While a transfer this side posted is in flight, seconds since the last progress
        during which NIXL is polled every ``min_sleep_s`` (0: back off as above instead).
    window_polls
        Polls a predicted landing's window (a quarter of the predicted time) is divided
        into, each at least ``min_sleep_s`` apart: a landing inside it is noticed at most
        1/``window_polls`` of the window late (by default 1/64 of the predicted time: 125
        us of an 8 ms transfer; a 1 MiB one's window is polled every ``min_sleep_s``).
    """

    spin_s: float = 100e-6
    min_sleep_s: float = 20e-6
    max_sleep_s: float = 500e-6
    sleep_fraction: float = 0.125
    inflight_s: float = 0.05
    window_polls: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.spin_s <= 1.0:
            raise ValueError(f"ProgressPolicy.spin_s must be in [0, 1] s, got {self.spin_s}")
        if not 0 < self.min_sleep_s <= self.max_sleep_s:
            raise ValueError(
                "ProgressPolicy needs 0 < min_sleep_s <= max_sleep_s, got "
                f"{self.min_sleep_s} and {self.max_sleep_s}"
            )
        if self.max_sleep_s > 0.1:
            raise ValueError(f"ProgressPolicy.max_sleep_s must be <= 0.1 s, got {self.max_sleep_s}")
        if not 0 < self.sleep_fraction <= 1:
            raise ValueError("ProgressPolicy.sleep_fraction must be in (0, 1], got "
                             f"{self.sleep_fraction}")
        if not 0 <= self.inflight_s <= 1.0:
            raise ValueError(f"ProgressPolicy.inflight_s must be in [0, 1] s, got "
                             f"{self.inflight_s}")
        if not 1 <= self.window_polls <= 1_000_000:
            raise ValueError("ProgressPolicy.window_polls must be in [1, 1000000], got "
                             f"{self.window_polls}")

    @classmethod
    def latency_first(cls) -> ProgressPolicy:
        """Poll closely (spins up to 1 ms around a predicted landing): lowest latency."""
        return cls(spin_s=1e-3, min_sleep_s=10e-6, max_sleep_s=50e-6, sleep_fraction=0.05,
                   inflight_s=0.2, window_polls=1_000_000)

    @classmethod
    def cpu_first(cls) -> ProgressPolicy:
        """Never spin, sleep longer between polls, none while in flight either: least
        CPU."""
        return cls(spin_s=0.0, min_sleep_s=100e-6, max_sleep_s=2e-3, sleep_fraction=0.25,
                   inflight_s=0.0, window_polls=4)


class Backoff:
    """The next poll delay under a :class:`ProgressPolicy`."""

    __slots__ = ("_last_progress", "_policy")

    def __init__(self, policy: ProgressPolicy) -> None:
        self._policy = policy
        self._last_progress = time.monotonic()

    def progressed(self) -> None:
        """Something moved: spin again."""
        self._last_progress = time.monotonic()

    def keep_polling(self) -> bool:
        """While a transfer this side posted is in flight: poll NIXL again after
        ``min_sleep_s`` rather than back off."""
        return time.monotonic() - self._last_progress < self._policy.inflight_s

    def next_delay(self, window: tuple[float, float] | None = None,
                   quiet_until: float | None = None) -> float:
        """Seconds to wait before the next poll (0.0 while spinning). ``window``: a
        (start, end) monotonic interval in which a completion is predicted: the delay never
        runs past its start, and inside it is one ``window_polls``-th of the window (at
        least ``min_sleep_s``). ``quiet_until``: a
        moment before which no poll can find anything (what is awaited moves without this
        side's progress and is predicted no earlier): the delay runs to it."""
        policy = self._policy
        now = time.monotonic()
        if quiet_until is not None and now < quiet_until:
            return quiet_until - now
        waited = now - self._last_progress
        if waited < policy.spin_s:
            return 0.0
        delay = min(policy.max_sleep_s, max(policy.min_sleep_s, waited * policy.sleep_fraction))
        if window is not None and now < window[1]:
            if now < window[0]:
                delay = min(delay, max(window[0] - now, policy.min_sleep_s))
            else:
                delay = min(delay, max(policy.min_sleep_s,
                                       (window[1] - window[0]) / policy.window_polls))
        return delay
