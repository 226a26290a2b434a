"""Predicted landings: how long a side waits, from the moment it hears that a transfer it
does not drive has begun (a push's ``Posted`` hint, a pull's ``PullBegin``) to the
notification that ends it, smoothed by the transfer's size class. The driver polls NIXL
closely around the predicted moment instead of all along (:mod:`kvpush.progress`), and
not at all before it when the bytes move without this side's progress: the hint then
carries ``inline_s``, how long the initiator's such posts take, which also bounds a quiet
wait (a prediction learnt from one slow transfer, the first to a peer say, would otherwise
keep quiet waits long for many requests: a quiet wait learns slowly, since it does not
look before the predicted moment).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["QUIET_MAX_S", "QUIET_MIN_S", "Landings", "PostTimes"]

#: The longest quiet wait (s), whatever a hint says: past it the driver polls as it backs
#: off (a peer's ``inline_s`` is not trusted to keep this side deaf for long).
QUIET_MAX_S = 1.0
#: The shortest predicted wait kept quiet (s). A quiet wait sees a landing that came
#: before its predicted moment only at that moment, and learns it coarsely; under a few
#: milliseconds the backoff's polls it saves are one or two, and the lateness it costs
#: shows (1 MiB pushes here: the notification seen 50-100 us later at the median).
QUIET_MIN_S = 2e-3


class Landings:
    """Smoothed begin-to-landing times by size class (a small int: a bit length)."""

    __slots__ = ("_took",)

    def __init__(self) -> None:
        self._took: dict[int, float] = {}

    def learn(self, size: int, began: float, seen: float, since: float | None) -> None:
        """A transfer of ``size`` heard of at ``began`` landed after ``since`` (the driver's
        last look that did not find it) and by ``seen``.

        The middle of that interval is learnt, not ``seen``: the driver sleeps until the
        predicted window opens, so a landing before the window is seen at its opening, and
        learning ``seen`` would never move the window earlier: every late sighting would
        move it later, until the window opens after the landings and each is seen a backoff
        sleep late. A landing seen at the window's opening after no look since ``began`` (a
        quiet wait, or the backoff's sleep to the window) pulls the prediction down by an
        eighth: the next window opens early, which costs polls; one that opened late would
        cost the landings' latency."""
        landed = seen if since is None else (max(began, min(since, seen)) + seen) / 2
        last = self._took.get(size)
        took = landed - began
        self._took[size] = took if last is None else 0.75 * last + 0.25 * took

    def window(self, now: float, spin_s: float,
               waits: Iterable[tuple[int, float, float]]) -> tuple[float, float] | None:
        """The earliest predicted landing still to come of ``waits`` ((size, began,
        inline_s) each): from its predicted moment, to be polled closely for a quarter of
        its predicted time (at least ``spin_s``). From the learnt time alone: the
        initiator's post time can be shorter than this side's wait (the hint's trip is
        not in it), and a window that closes before the landing leaves it to the backoff's
        longest sleep (1 MiB pushes here: seen 50-80 us later at the median)."""
        best: tuple[float, float] | None = None
        for size, began, _ in waits:
            took = self._took.get(size)
            if took is None:
                continue
            start = began + took
            end = start + max(0.25 * took, spin_s)
            if end > now and (best is None or start < best[0]):
                best = (start, end)
        return best

    def quiet_until(self, now: float,
                    waits: Iterable[tuple[int, float, float]]) -> float | None:
        """Until when nothing of ``waits`` ((size, began, inline_s) each) needs a poll: the
        earliest predicted landing, when every wait was hinted ``inline_s`` (its bytes move
        without this side's progress) and is predicted to take :data:`QUIET_MIN_S` or more;
        None otherwise, or once it has come. Never more than :data:`QUIET_MAX_S` after a wait
        began."""
        until = math.inf
        for size, began, inline_s in waits:
            if not 0.0 < inline_s < math.inf:
                return None
            took = min(self._took.get(size, math.inf), inline_s)  # the learnt, at most the hint
            if took < QUIET_MIN_S:
                return None
            until = min(until, began + min(took, QUIET_MAX_S))
        return until if now < until < math.inf else None


class PostTimes:
    """What an initiator says in its hints (``Posted.inline_s``, ``PullBegin.inline_s``):
    by peer and size class, how long its posts take when they end inside the post call.

    The shorter of the last two such posts, and nothing until two have: the first transfer
    to a new peer takes 11-16 ms here (UCX sets up the connection), and a hint that said so
    would keep the peer's next quiet wait that long for a 1 ms transfer. Saying too little
    only costs the peer polls. A post that did not end inside the call takes it back."""

    __slots__ = ("_by_peer",)

    def __init__(self) -> None:
        self._by_peer: dict[str, dict[int, tuple[float, float]]] = {}

    def ended(self, peer: str, size: int, inline_s: float) -> None:
        """A transfer of ``size`` to ``peer`` ended DONE; ``inline_s`` > 0: inside its post,
        which took that long."""
        if inline_s > 0:
            sizes = self._by_peer.setdefault(peer, {})
            sizes[size] = (sizes.get(size, (math.inf, math.inf))[1], inline_s)
        elif peer in self._by_peer:
            self._by_peer[peer].pop(size, None)

    def hint(self, peer: str, size: int) -> float:
        """``inline_s`` for the next hint of ``size`` to ``peer`` (0.0: none)."""
        prev, last = self._by_peer.get(peer, {}).get(size, (math.inf, math.inf))
        return 0.0 if math.isinf(prev) else min(prev, last)

    def forget(self, peer: str) -> None:
        self._by_peer.pop(peer, None)
