"""Deadlines with callbacks, for the protocol cores and the loop thread.

A request arms several deadlines that almost never fire: the registration's wait (up to
``max_wait_s``), the WRITE's ``transfer_timeout_s``, the source's lease; each is cancelled
as the request moves on. And every ended use keeps a tombstone for ``tombstone_s`` (120 s).
A heap that keeps each cancelled entry, with the closure it would have run, until its
deadline comes round holds hundreds of thousands of them at 1,000 requests/s, and
Python's garbage collector walks all of them on every full collection.

So a cancelled timer lets go of its callback at once; cancelled entries leave the heap
once they are more than half of it (as asyncio's event loop does); and timers whose
deadlines come in arming order (a constant delay: tombstones) wait in a FIFO lane beside
the heap, so a compaction never re-sorts them. A timer can hold one argument for a
function shared by many, instead of a closure each. Memory and collector work then follow
the timers that can still fire (the figures: ``docs/BENCHMARKS.md``).

Pop order is by (deadline, arming order) whatever the lanes' shapes, so a seeded
simulation replays exactly (its trace hashes did not change).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial

__all__ = ["Timer", "TimerHeap"]

#: Cancelled entries tolerated in a heap before it is compacted, whatever its size.
COMPACT_MIN = 64


class Timer:
    """One deadline. :meth:`cancel` makes it a no-op and drops its callback; a timer that
    fired counts as cancelled too."""

    __slots__ = ("_heap", "arg", "deadline", "fn")

    def __init__(self, heap: TimerHeap | None, deadline: float, fn: Callable[..., None],
                 arg: object = None) -> None:
        self._heap = heap          # the heap holding this entry; None once out of it
        self.deadline = deadline
        self.fn: Callable[..., None] | None = fn
        self.arg = arg             # passed first to fn when not None

    @property
    def cancelled(self) -> bool:
        """True once cancelled or fired."""
        return self.fn is None

    def cancel(self) -> None:
        """Make this timer a no-op and let go of its callback (idempotent)."""
        if self.fn is None:
            return
        self.fn = self.arg = None
        heap, self._heap = self._heap, None
        if heap is not None:
            heap._cancelled_one()


class TimerHeap:
    """Timers ordered by (deadline, arming order). Not thread-safe: one owner.

    Two lanes: a heap, and a FIFO for timers armed with ``fifo=True`` whose deadlines come
    in arming order (a constant delay from a clock that does not go back: tombstones).
    A large population of such timers -- every use of the last two minutes keeps one --
    then costs no heap work, and does not make each compaction of the heap re-sort it."""

    __slots__ = ("_cancelled", "_entries", "_fifo", "_seq")

    def __init__(self) -> None:
        self._entries: list[tuple[float, int, Timer]] = []
        self._fifo: deque[tuple[float, int, Timer]] = deque()
        self._seq = itertools.count()
        self._cancelled = 0      # cancelled timers still in _entries

    def __len__(self) -> int:
        """Entries held, cancelled ones not yet dropped included."""
        return len(self._entries) + len(self._fifo)

    def add(self, deadline: float, fn: Callable[..., None], arg: object = None, *,
            fifo: bool = False) -> Timer:
        """A timer that calls ``fn(*args)`` when due (the owner's arguments, e.g. ``now``);
        with ``arg``, ``fn(arg, *args)``: many timers can share one function and hold only
        their argument, not a closure each. ``fifo``: the deadline is expected to be no
        earlier than that of the last ``fifo`` timer (one that is goes to the heap)."""
        in_fifo = fifo and (not self._fifo or deadline >= self._fifo[-1][0])
        # Only the heap counts its cancelled entries; the FIFO drops them when they come first.
        timer = Timer(None if in_fifo else self, deadline, fn, arg)
        entry = (deadline, next(self._seq), timer)
        if in_fifo:
            self._fifo.append(entry)
        else:
            heapq.heappush(self._entries, entry)
        return timer

    def _first(self) -> tuple[float, int, Timer] | None:
        """The earliest entry that can still fire (cancelled ones before it dropped)."""
        entries, fifo = self._entries, self._fifo
        while entries and entries[0][2].fn is None:
            heapq.heappop(entries)
            self._cancelled -= 1
        while fifo and fifo[0][2].fn is None:
            fifo.popleft()
        if not fifo:
            return entries[0] if entries else None
        if not entries:
            return fifo[0]
        return (min(entries[0][:2], fifo[0][:2]) == entries[0][:2] and entries[0]) or fifo[0]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a timer that can still fire."""
        first = self._first()
        return None if first is None else first[0]

    def pop_due(self, now: float) -> Iterator[Callable[..., None]]:
        """The callbacks of the timers due by ``now``, in order; each timer counts as
        cancelled before its callback is handed out. A callback may arm or cancel timers
        (one armed due by ``now`` comes out in this same pass)."""
        while (first := self._first()) is not None and first[0] <= now:
            if self._fifo and first is self._fifo[0]:
                self._fifo.popleft()
            else:
                heapq.heappop(self._entries)
            timer = first[2]
            fn, arg = timer.fn, timer.arg
            assert fn is not None
            timer.fn = timer.arg = timer._heap = None
            yield fn if arg is None else partial(fn, arg)

    def clear(self) -> None:
        """Drop every timer (each counts as cancelled)."""
        for _, _, timer in (*self._entries, *self._fifo):
            timer.fn = timer.arg = timer._heap = None
        self._entries.clear()
        self._fifo.clear()
        self._cancelled = 0

    def _cancelled_one(self) -> None:
        self._cancelled += 1
        if self._cancelled > COMPACT_MIN and 2 * self._cancelled > len(self._entries):
            # In place: a pop_due pass in progress keeps using the same list.
            self._entries[:] = [e for e in self._entries if e[2].fn is not None]
            heapq.heapify(self._entries)
            self._cancelled = 0
