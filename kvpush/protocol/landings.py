"""Predicted landings: how long a side waits, from the moment it hears that a transfer it
does not drive has begun (a push's ``Posted`` hint, a pull's ``PullBegin``) to the
notification that ends it, smoothed by the transfer's size class. The driver polls NIXL
closely around the predicted moment instead of all along (:mod:`kvpush.progress`), and
not at all before it when the bytes move without this side's progress (``inline``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["Landings"]


class Landings:
    """Smoothed begin-to-landing times by size class (a small int: a bit length)."""

    __slots__ = ("_took",)

    def __init__(self) -> None:
        self._took: dict[int, float] = {}

    def took(self, size: int) -> float | None:
        """The predicted begin-to-landing time of ``size`` (None: none seen yet)."""
        return self._took.get(size)

    def learn(self, size: int, began: float, seen: float, since: float | None) -> None:
        """A transfer of ``size`` heard of at ``began`` landed after ``since`` (the driver's
        last look that did not find it) and by ``seen``.

        The middle of that interval is learnt, not ``seen``: the driver sleeps until the
        predicted window opens, so a landing before the window is seen at its opening, and
        learning ``seen`` would never move the window earlier: every late sighting would
        move it later, until the window opens after the landings and each is seen a backoff
        sleep late.

        But no earlier than a window's length (a quarter of the prediction) before ``seen``:
        a side that waits quietly looks first at the window's opening, so a landing seen
        there was last not seen at ``began``, and the middle of that whole span would pull
        the prediction down by an eighth for every early landing."""
        landed = seen if since is None else (max(began, min(since, seen)) + seen) / 2
        last = self._took.get(size)
        if last is not None:
            landed = max(landed, seen - 0.25 * last)
        took = landed - began
        self._took[size] = took if last is None else 0.75 * last + 0.25 * took

    def window(self, now: float, spin_s: float,
               waits: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
        """The earliest predicted landing still to come of ``waits`` ((size, began) each):
        from its predicted moment, to be polled closely for a quarter of its predicted time
        (at least ``spin_s``)."""
        best: tuple[float, float] | None = None
        for size, began in waits:
            took = self._took.get(size)
            if took is None:
                continue
            start = began + took
            end = start + max(0.25 * took, spin_s)
            if end > now and (best is None or start < best[0]):
                best = (start, end)
        return best

    def quiet_until(self, now: float,
                    waits: Iterable[tuple[int, float, bool]]) -> float | None:
        """Until when nothing of ``waits`` ((size, began, inline) each) needs a poll: the
        earliest predicted landing, when every wait is ``inline`` (its bytes move without
        this side's progress) and has a prediction; None otherwise, or once it has come."""
        until = math.inf
        for size, began, inline in waits:
            took = self._took.get(size)
            if took is None or not inline:
                return None
            until = min(until, began + took)
        return until if now < until < math.inf else None
