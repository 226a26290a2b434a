"""Stage stamps of kvpush's hot path, for the benchmarks (not public).

Off by default: every stamp site is ``if _trace.ON: _trace.stamp(...)``, one module
attribute test (tens of ns) when off. On (:func:`enable`), each site appends
``(stage, time.monotonic_ns())`` to :data:`STAMPS`; the monotonic clock is shared by the
processes of one host, so a benchmark can line up a producer's stamps with its consumer's.
Appending to a list is atomic under the GIL, so the engine's and the loop's threads may
both stamp.
"""

from __future__ import annotations

import time

__all__ = ["ON", "STAMPS", "enable", "stamp", "take"]

ON = False
STAMPS: list[tuple[str, int]] = []


def enable(on: bool = True) -> None:
    """Turn stamping on (or off) and forget the stamps so far."""
    global ON
    ON = on
    STAMPS.clear()


def stamp(stage: str) -> None:
    STAMPS.append((stage, time.monotonic_ns()))


def take() -> list[tuple[str, int]]:
    """The stamps so far (and forget them)."""
    out = STAMPS[:]
    del STAMPS[:len(out)]
    return out
